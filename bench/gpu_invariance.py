"""bench/gpu_check.py's batch-invariance sections: the products (kernels/matmul.py against
cuBLAS's, timed side by side, and whether a row's bits follow its batch in each), and the
engine's replies, greedy and seeded, alone, beside 248 others, cached and cold.

A section takes the check's own `line` (one figure a line) and `bench` (ms a call).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kiln.kernels.matmul import matmul
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.engine_request import EngineRequest, RequestOptions
from kiln.runtime.engine.llm_engine import LLMEngine
from kiln.runtime.sampling.params import SamplingParams

# (rows, outputs, inputs): a Llama-3.2-1B-class layer's products at decode batches 1 and 64,
# a decode batch of 256 on the down projection, the LM head at one row, a 4k-token prefill
PRODUCTS = [(1, 2048, 2048), (64, 16384, 2048), (256, 2048, 8192), (1, 128256, 2048),
            (4096, 16384, 2048)]
DRY_PRODUCTS = [(1, 96, 64), (37, 200, 128)]


def check_products(device: str, dry: bool, line, bench) -> None:
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    for M, N, K in DRY_PRODUCTS if dry else PRODUCTS:
        x = torch.randn(M, K, generator=gen).to(device=device, dtype=dt)
        w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(device=device, dtype=dt)
        ours = bench(lambda x=x, w=w: matmul(x, w))
        theirs = bench(lambda x=x, w=w: F.linear(x, w))
        line(f"product {M} x {N} x {K} batch-invariant", ours, "ms",
             f"cuBLAS {theirs:.4f} ms: {theirs / ours:.2f}x, {2 * M * N * K / ours / 1e9:.0f} "
             "TFLOP/s" if not dry else "(dry run)")
    # A row alone, and the same row inside 256 others (at another place in its tile).
    M, N, K = (256, 2048, 2048) if not dry else (37, 96, 64)
    x = torch.randn(M, K, generator=gen).to(device=device, dtype=dt)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(device=device, dtype=dt)
    for name, fn in (("batch-invariant", matmul), ("cuBLAS", F.linear)):
        full = fn(x, w)
        same = all(torch.equal(fn(x[i:i + 1], w), full[i:i + 1]) for i in (0, 5, M - 1))
        line(f"a row's bits alone and in {M} rows, {name}", "same" if same else "differ",
             "", "ok" if same or name == "cuBLAS" else "FAIL")
        if not same and name != "cuBLAS":
            raise AssertionError(f"{name} products follow the batch")


def _replies(engine: LLMEngine, requests: list[tuple[str, EngineRequest]]
             ) -> dict[str, list[tuple[int, float]]]:
    out = {rid: [] for rid, _ in requests}
    for rid, er in requests:
        engine.add_request(engine.make_request(rid, er))
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id in out:
                out[o.request_id] += [(lp.token_id, lp.logprob) for lp in o.new_logprobs or ()]
    return out


def check_engine(loaded, device: str, dry: bool, line) -> None:
    """8 requests (4 greedy, 4 seeded) alone and cold, then inside a batch of 256 (248 others
    beside them), then alone again with their prompts cached: the same token ids and logprob
    values each time, on the loaded model's products. A dry run: 4 short ones beside 4."""
    V = loaded.config.vocab_size
    rng = np.random.default_rng(5)
    n, length = (4, 10) if dry else (8, 64)
    mine = [(f"m{i}", EngineRequest(
        rng.integers(0, V, length + 16 * i).tolist(),
        SamplingParams(temperature=0.0) if i < n // 2 else
        SamplingParams(temperature=0.8, seed=i),
        RequestOptions(max_tokens=2 if dry else 16, ignore_eos=True, logprobs=1)))
        for i in range(n)]
    others = [(f"o{i}", EngineRequest(rng.integers(0, V, 2 * length).tolist(),
                                      SamplingParams(temperature=1.0, seed=100 + i),
                                      RequestOptions(max_tokens=3 if dry else 24,
                                                     ignore_eos=True)))
              for i in range(n if dry else 248)]
    engine = LLMEngine(loaded, EngineConfig(
        ctx_len=1024, prefill_chunk_len=512 if dry else 2048, kv_cache_tokens=256 * 160 + 4096,
        max_num_seqs=256, device=device, use_triton=True, cuda_graphs=device == "cuda"))
    cold = {}
    for req in mine:
        cold |= _replies(engine, [req])
        engine.reset_prefix_cache()
    batched = _replies(engine, others[:len(others) // 2] + mine + others[len(others) // 2:])
    batched = {rid: batched[rid] for rid, _ in mine}
    cached = {}
    for req in mine:
        cached |= _replies(engine, [req])
    what = "batch-invariant" if loaded.model.backend.batch_invariant else "cuBLAS"
    for name, got in ((f"inside a batch of {len(mine) + len(others)}", batched),
                      ("cached", cached)):
        same = got == cold
        differ = sum(got[rid] != cold[rid] for rid in cold)
        line(f"{n} replies alone vs {name}, {what}", "same" if same else f"{differ} differ", "",
             "ok" if same or what == "cuBLAS" else "FAIL")
        if not same and what != "cuBLAS":
            raise AssertionError(f"replies {name} differ from alone")
    del engine
