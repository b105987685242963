"""bench/gpu_check.py's engine sections: decode steps without HTTP at several batch sizes,
with and without CUDA graphs, the prefill before them, and with graphs the steps that bring
a prompt beside the decoding rows, through the piecewise graphs and eagerly.

A section takes the check's own `line` (one figure a line).
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch
import triton

from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.engine_request import EngineRequest, RequestOptions
from kiln.runtime.engine.llm_engine import LLMEngine
from kiln.runtime.models.loader import LoadedModel
from kiln.runtime.sampling.params import SamplingParams


def prefill(engine: LLMEngine, rng, params: SamplingParams, B: int, length: int,
            tag: str) -> float:
    """Seconds until B new prompts of `length` tokens each have their first token."""
    for i in range(B):
        prompt = rng.integers(0, engine.vocab_size, length).tolist()
        engine.add_request(engine.make_request(f"{B}-{tag}{i}", EngineRequest(
            prompt, params, RequestOptions(max_tokens=800, ignore_eos=True))))
    t0 = time.perf_counter()
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()
    return time.perf_counter() - t0


def _syncs(engine: LLMEngine, device: str) -> str:
    """The host's waits for the device in one step that torch's sync debug mode sees (the
    samples' wait, and any .item() or copy to pageable memory)."""
    if device != "cuda":
        return "n/a (CPU)"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        engine.step()
        torch.cuda.set_sync_debug_mode("default")
    return str(sum("synchroniz" in str(w.message) for w in caught))


def _step_ms(engine: LLMEngine, steps: int) -> float:
    """Milliseconds a decode step, over `steps` steps after two untimed ones (with
    --async-scheduling, a step's tokens are read during the next: the run settles first)."""
    for _ in range(2):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1000


def _mixed_ms(engine: LLMEngine, rng, params: SamplingParams, length: int, reps: int,
              tag: str) -> float:
    """Milliseconds of a step that brings a new `length`-token prompt beside the running
    rows (the step after every arrival; the prompt's one token ends its reply)."""
    total = 0.0
    for i in range(reps):
        prompt = rng.integers(0, engine.vocab_size, length).tolist()
        engine.add_request(engine.make_request(f"mixed-{tag}{i}", EngineRequest(
            prompt, params, RequestOptions(max_tokens=1, ignore_eos=True))))
        t0 = time.perf_counter()
        engine.step()
        total += time.perf_counter() - t0
    return total / reps * 1000


def _time_mixed(engine: LLMEngine, rng, params: SamplingParams, B: int, dry: bool, line,
                label: str, mode: str) -> None:
    """Mixed steps through the piecewise graphs against the same steps' eager forward, on
    the same engine and batch, alternating."""
    pieces, length = engine.runner.pieces, 16 if dry else 100
    times: dict[bool, list[float]] = {True: [], False: []}
    for i, on in enumerate((True, False) * (1 if dry else 3)):
        engine.runner.pieces = pieces if on else None
        times[on].append(_mixed_ms(engine, rng, params, length, 1 if dry else 8, f"{B}-{i}"))
    engine.runner.pieces = pieces
    ms, eager_ms = min(times[True]), min(times[False])
    line(f"mixed step {label} batch {B} + 1 x {length} {mode} pieces", ms, "ms",
         f"the same steps' eager forward {eager_ms:.3f} ms: pieces {eager_ms / ms:.2f}x")


def time_engine(loaded: LoadedModel, device: str, dry: bool, line, label: str, batches,
                graphs: bool, invariant: bool) -> None:
    """Engine steps without HTTP: the prefill of B 128-token prompts (16 in a dry run: the
    interpreter takes seconds a layer), then decode steps."""
    length = 16 if dry else 128
    compiled_after_load = []
    mode = ("graphs" if graphs else "eager") + (" invariant" if invariant else " cuBLAS")
    config = EngineConfig(ctx_len=1024 if dry else 4096, prefill_chunk_len=2048,
                          kv_cache_tokens=max(batches) * 256 + 4096,
                          max_num_seqs=max(batches), device=device, use_triton=True,
                          cuda_graphs=graphs)  # off CUDA the padded buckets replay eagerly
    t0 = time.perf_counter()
    engine = LLMEngine(loaded, config)
    line(f"engine load {label} {mode} (warm-up, capture)", time.perf_counter() - t0, "s")
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiled_after_load.append(1)
    try:
        rng = np.random.default_rng(2)
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=3)
        for B in batches:
            # Twice at the largest batch: the first prefill of a size meets the allocator's
            # first blocks of each activation shape; an engine's second shows what is left
            # (issue 27: graphs mode prefilled slower than eager, the engine made first).
            again = ""
            if B == max(batches) and not dry:
                again_s = prefill(engine, rng, params, B, length, "warm")
                for rid in list(engine.requests):
                    engine.abort(rid)
                again = f" (the first prefill of this size took {again_s * 1000:.0f} ms)"
            prefill_s = prefill(engine, rng, params, B, length, "")
            steps = 2 if dry else 48
            for _ in range(2):
                engine.step()
            syncs = _syncs(engine, device)
            ms = _step_ms(engine, steps)
            line(f"decode step {label} batch {B} {mode}", ms, "ms",
                 f"{B / ms * 1000:.0f} tok/s; host syncs in a step: {syncs}; prefill "
                 f"{B} x {length} in {prefill_s * 1000:.0f} ms{again}")
            if graphs and invariant:  # the same steps, the sampler's kernels launched eagerly
                decode = engine.runner.graphs
                decode.with_sampler = False
                eager_ms = _step_ms(engine, steps)
                decode.with_sampler = True
                line(f"decode step {label} batch {B} {mode} sampler eager", eager_ms, "ms",
                     f"the sampler's graph (above): {eager_ms / ms:.2f}x faster")
            if graphs and invariant:  # kiln serve --async-scheduling, on the same batch
                engine.async_scheduling = True
                engine.step()  # a step in flight from here on
                async_syncs = _syncs(engine, device)
                async_ms = _step_ms(engine, steps)
                engine.async_scheduling = False
                line(f"decode step {label} batch {B} {mode} async", async_ms, "ms",
                     f"{B / async_ms * 1000:.0f} tok/s; {ms / async_ms:.2f}x the synchronous "
                     f"steps above; host syncs in a step: {async_syncs}")
            if graphs:  # a prompt arriving beside the B rows: the pieces' step
                _time_mixed(engine, rng, params, B, dry, line, label, mode)
            for rid in list(engine.requests):
                engine.abort(rid)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
        del engine  # its KV cache, before the next one is allocated
    if dry:
        line(f"kernels compiled after load ({label} {mode})", "n/a", "", "(the interpreter "
             "compiles nothing: tests/test_aot_compile.py checks the variants)")
    else:
        line(f"kernels compiled after load ({label} {mode})", len(compiled_after_load), "",
             "ok" if not compiled_after_load else "FAIL: a step met a variant not warmed")
