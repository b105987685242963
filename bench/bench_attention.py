"""Paged attention: the Triton kernel (CUDA only) and the torch reference against torch SDPA
over the same K/V already gathered into a contiguous cache (the gather is not timed).

    .venv/bin/python -m pytest -q bench/bench_attention.py --benchmark-enable

Every benchmark records `kv_GB/s` in extra_info: the bytes of K/V a sequence batch has to
read (each cached position once) over the mean time. On CPU the Triton kernel is skipped
(the interpreter's timing means nothing) and cases above CPU_MAX_KV_BYTES are skipped.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kiln.kernels import BLOCK_SIZE
from kiln.kernels.attention import paged_attention
from kiln.kernels.attention_ref import paged_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # bf16 is slow on the dev CPU
CPU_MAX_KV_BYTES = 128 << 20

SHAPES = {"smollm2": (9, 3, 64), "d128": (32, 8, 128)}  # (num_heads, num_kv_heads, head_dim)
MODES = {"decode": (1024, 1), "prefill": (384, 128)}  # (context_len, query_len) of every seq
BATCHES = [1, 32, 256]


@dataclass
class Workload:
    paged_args: tuple  # query, key_cache, value_cache, block_tables, seq_lens, query_start_loc
    dense_q: torch.Tensor  # [batch, num_heads, query_len, head_dim]
    dense_k: torch.Tensor  # [batch, num_kv_heads, seq_len, head_dim], contiguous
    dense_v: torch.Tensor
    mask: torch.Tensor | None  # [query_len, seq_len] bool, True = attend
    scale: float
    kv_bytes: int


def make_workload(shape: str, mode: str, batch: int) -> Workload:
    num_heads, num_kv_heads, head_dim = SHAPES[shape]
    context_len, query_len = MODES[mode]
    seq_len = context_len + query_len
    kv_bytes = 2 * batch * seq_len * num_kv_heads * head_dim * DTYPE.itemsize
    if DEVICE == "cpu" and kv_bytes > CPU_MAX_KV_BYTES:
        pytest.skip(f"{kv_bytes >> 20} MiB of K/V is too big for a CPU bench")
    blocks_per_seq = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    randn = lambda *s: torch.randn(*s, generator=gen, device=DEVICE, dtype=DTYPE)
    key_cache = randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    value_cache = randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    block_tables = torch.randperm(num_blocks, generator=gen, device=DEVICE).view(
        batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=DEVICE)
    query_start_loc = (torch.arange(batch + 1, device=DEVICE) * query_len).int()
    query = randn(batch * query_len, num_heads, head_dim)

    gather = lambda cache: cache[block_tables.long()].flatten(1, 2)[:, :seq_len].transpose(
        1, 2).contiguous()
    mask = None
    if query_len > 1:
        q_pos = torch.arange(context_len, seq_len, device=DEVICE)[:, None]
        mask = torch.arange(seq_len, device=DEVICE)[None, :] <= q_pos
    return Workload(
        (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc),
        query.view(batch, query_len, num_heads, head_dim).transpose(1, 2),
        gather(key_cache), gather(value_cache), mask, head_dim ** -0.5, kv_bytes)


def run(benchmark, fn, kv_bytes: int) -> None:
    if DEVICE == "cuda":
        timed = lambda: (fn(), torch.cuda.synchronize())
    else:
        timed = fn
    benchmark(timed)
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["kv_GB/s"] = round(kv_bytes / benchmark.stats.stats.mean / 1e9, 2)
    benchmark.extra_info["kv_MiB"] = round(kv_bytes / 2**20, 1)


CASES = pytest.mark.parametrize(
    "shape, mode, batch", [(s, m, b) for s in SHAPES for m in MODES for b in BATCHES])


@CASES
def test_paged_attention_triton(benchmark, mode, shape, batch):
    if DEVICE != "cuda":
        pytest.skip("Triton on CPU runs in the interpreter: its timing means nothing")
    w = make_workload(shape, mode, batch)
    benchmark.group = f"{shape}-{mode}-b{batch}"
    run(benchmark, lambda: paged_attention(*w.paged_args, scale=w.scale), w.kv_bytes)


@CASES
def test_paged_attention_reference(benchmark, mode, shape, batch):
    w = make_workload(shape, mode, batch)
    benchmark.group = f"{shape}-{mode}-b{batch}"
    run(benchmark, lambda: paged_attention_ref(*w.paged_args, scale=w.scale), w.kv_bytes)


@CASES
def test_sdpa_over_gathered_cache(benchmark, mode, shape, batch):
    w = make_workload(shape, mode, batch)
    benchmark.group = f"{shape}-{mode}-b{batch}"
    sdpa = lambda: F.scaled_dot_product_attention(
        w.dense_q, w.dense_k, w.dense_v, attn_mask=w.mask, scale=w.scale, enable_gqa=True)
    run(benchmark, sdpa, w.kv_bytes)
