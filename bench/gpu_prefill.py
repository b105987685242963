"""bench/gpu_check.py's prefill attention section: kiln's paged attention over whole prompts
with programs of 1, 2 and 4 query tiles of 16 rows (each K/V tile read once for a program's
tiles) and of one 64-row tile (a Hopper warpgroup's wgmma), against torch's
scaled_dot_product_attention (the flash backend on a GPU) on the same prompts, and whether
each row's bits are the same whatever the tile count.

A section takes the check's own `line` (one figure a line) and `bench` (ms a call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kiln.kernels.attention import TILE_ROWS, paged_attention, prefill_tiles

# (name, prompts, tokens each, heads, kv heads, head_dim): the default model's shape and a
# Llama-3.2-1B-class one (issue 27's 64 x 2,048 prefill)
PREFILLS = [("smollm2-135m", 64, 2048, 9, 3, 64), ("llama-1b", 64, 2048, 32, 8, 64),
            ("llama-1b", 4, 8192, 32, 8, 64)]
DRY_PREFILLS = [("smollm2-135m", 2, 48, 6, 2, 64)]
BLOCK = 16


def prompts(B: int, L: int, heads: int, kv_heads: int, D: int, dtype, device, seed=0):
    """B prompts of L tokens in a shuffled paged cache: (paged attention's args, the same
    q, k, v as [B, heads, L, D] for SDPA, K/V heads repeated to the query heads)."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = L // BLOCK
    q = torch.randn((B, L, heads, D), generator=g, device=device).to(dtype)
    k = torch.randn((B, L, kv_heads, D), generator=g, device=device).to(dtype)
    v = torch.randn((B, L, kv_heads, D), generator=g, device=device).to(dtype)
    perm = torch.randperm(B * blocks, generator=g, device=device)
    key_cache = torch.empty((B * blocks, BLOCK, kv_heads, D), dtype=dtype, device=device)
    value_cache = torch.empty_like(key_cache)
    key_cache[perm] = k.reshape(B * blocks, BLOCK, kv_heads, D)
    value_cache[perm] = v.reshape(B * blocks, BLOCK, kv_heads, D)
    i32 = dict(dtype=torch.int32, device=device)
    paged = (q.reshape(B * L, heads, D), key_cache, value_cache,
             perm.view(B, blocks).to(torch.int32), torch.full((B,), L, **i32),
             torch.arange(0, B * L + 1, L, **i32))
    group = heads // kv_heads
    dense = (q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(group, 1),
             v.transpose(1, 2).repeat_interleave(group, 1))
    return paged, dense


def check_prefill_attention(device: str, dry: bool, line, bench) -> None:
    for shape in DRY_PREFILLS if dry else PREFILLS:
        _time_prefill(*shape, device, line, bench)
        if device == "cuda":
            torch.cuda.empty_cache()


def _time_prefill(name, B, L, heads, kv_heads, D, device, line, bench) -> None:
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    paged, (q, k, v) = prompts(B, L, heads, kv_heads, D, dt, device)
    scale = D ** -0.5
    run = {(rows, tiles): (lambda r=rows, t=tiles: paged_attention(
        *paged, scale=scale, max_seq_len=L, max_query_len=L, tiles=t, rows=r))
        for rows, tiles in ((16, 1), (16, 2), (16, 4), (64, 1))}
    one = run[16, 1]()
    same = all(torch.equal(one, run[16, t]()) for t in (2, 4))
    wide = (run[64, 1]().float() - one.float()).abs().max()
    backend = SDPBackend.FLASH_ATTENTION if device == "cuda" else SDPBackend.MATH

    def sdpa():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    err = (one.float() - sdpa().transpose(1, 2).reshape(one.shape).float()).abs().max()
    flops = 4 * B * heads * D * L * (L + 1) / 2  # QK^T and PV over the causal half
    ms_sdpa = bench(sdpa)
    shape = f"{name} {B} x {L}"
    line(f"prefill attention {shape}: bits alike at 1, 2, 4 tiles", same, "",
         "ok" if same else "FAIL: a row's bits follow its program's tile count")
    line(f"prefill attention {shape}: max abs err vs SDPA", float(err))
    line(f"prefill attention {shape}: max abs diff of 64-row tiles vs 16", float(wide), "",
         "(one shape a model: decode and prefill take the same, so either keeps the "
         "invariance)")
    for (rows, tiles), fn in run.items():
        ms = bench(fn)
        default = " (kiln's choice)" if (rows, tiles) == (
            TILE_ROWS, prefill_tiles(D, dt)) else ""
        line(f"prefill attention {shape} rows={rows} tiles={tiles}", ms, "ms",
             f"{flops / ms / 1e9:.0f} TFLOP/s; SDPA ({backend.name.lower()}) {ms_sdpa:.3f} "
             f"ms: kiln {ms_sdpa / ms:.2f}x{default}")
