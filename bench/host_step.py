"""Time the host's part of an engine step: what the CPU does while a GPU would run the forward.

    .venv/bin/python bench/host_step.py --batch 1,64,256 --context 1024,4096

A tiny random model is served by an LLMEngine whose forward is replaced by a stand-in that
returns zero logits over a 256-token vocabulary (so the sampler's device work is nothing and
its host work, the metadata, is what is left). Each batch runs `batch` sampled requests
(temperature, top-p, a repetition penalty: the metadata's full width) whose prompts fill
`context` positions, then times decode steps: the scheduler, the runner's packing of the
step's inputs, the sampler's metadata, the step's bookkeeping (the scheduler's update, the
prefix cache's new full blocks, the outputs). On a GPU none of it overlaps the forward, so a
batch-1 step is never faster than this. A step's Python work should not grow with the
context: compare the rows of one batch size. The first column (host) is timed in a run of
its own: the phases' timers cost ~0.5 us a call, and two phases are called once a row. The
second is the same steps with --async-scheduling: the same work in another order (each
step's tokens read after the next step is launched), which a GPU would run beside its
forward instead of before it. The third (mixed) is a step that brings a new 100-token prompt
beside the batch's decode rows: the step after every arrival.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln.runtime.backends.dense import DenseBackend  # noqa: E402
from kiln.runtime.engine.config import EngineConfig  # noqa: E402
from kiln.runtime.engine.engine_request import EngineRequest, RequestOptions  # noqa: E402
from kiln.runtime.engine.llm_engine import LLMEngine  # noqa: E402
from kiln.runtime.models import llama  # noqa: E402
from kiln.runtime.models.loader import LoadedModel  # noqa: E402
from kiln.runtime.sampling import sampler as sampler_module  # noqa: E402
from kiln.runtime.sampling.params import SamplingParams  # noqa: E402
from kiln.runtime.store.gguf_file import open_gguf  # noqa: E402

VOCAB = 256


def tiny_model(directory: Path) -> LoadedModel:
    """One layer, one KV head: the KV cache of 256 x 4k tokens stays small."""
    path = directory / "host-step.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "context_length": 32768, "embedding_length": 64,
                       "feed_forward_length": 64, "attention.head_count": 1,
                       "attention.head_count_kv": 1, "rope.dimension_count": 64,
                       "vocab_size": VOCAB}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    zeros = np.zeros
    w.add_tensor("token_embd.weight", zeros((VOCAB, 64), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    for name in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{name}.weight", np.ones(64, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                 "ffn_down"):
        w.add_tensor(f"blk.0.{name}.weight", zeros((64, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gf = open_gguf(path)
    cfg = llama.read_config(gf)
    backend = DenseBackend("cpu", torch.float16)
    return LoadedModel(path.stem, path, None, cfg, tokenizer=None, chat_template=None,
                       model=llama.build(cfg, gf, backend), load_seconds=0.0)


class Timers:
    """Seconds per phase, each phase a function or method wrapped in place until exit."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self._wrapped: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t
        self._wrapped.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, timed)

    def __enter__(self) -> Timers:
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, before in reversed(self._wrapped):
            if before is None:
                delattr(owner, name)  # the class's own method shows through again
            else:
                setattr(owner, name, before)


PHASES = ("host", "host (async)", "host (mixed)", "schedule", "prepare inputs",
          "sampler metadata", "take tokens", "fetch samples", "update (prefix cache)",
          "outputs", "rest")


def run(loaded: LoadedModel, batch: int, context: int, steps: int) -> dict[str, float]:
    # room for the tokens the first requests decode while the last ones prefill
    ctx_len = context + batch + 3 * steps + 64
    config = EngineConfig(ctx_len=ctx_len, prefill_chunk_len=4096,
                          kv_cache_tokens=batch * ctx_len + 4096, max_num_seqs=batch,
                          device="cpu")
    engine = LLMEngine(loaded, config)
    logits = torch.zeros((batch, VOCAB), dtype=torch.float32)
    forward = collections.Counter()

    def execute(inp):  # the device's part: nothing here
        forward["steps"] += 1
        return logits[:len(inp.sampling_requests)] if inp.sampling_requests else None
    engine.runner.execute = execute
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1)
    for i in range(batch):
        prompt = rng.integers(0, VOCAB, context).tolist()
        engine.add_request(engine.make_request(f"r{i}", EngineRequest(
            prompt, params, RequestOptions(ignore_eos=True))))
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()  # prefill (on the stand-in: bookkeeping only)
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == batch, "every request decodes"
    host = {}
    for overlap in (False, True):  # the same steps synchronous, then with --async-scheduling
        engine.async_scheduling = overlap
        for _ in range(2 * overlap):
            engine.step()  # into the overlap's run: a step always in flight
        with Timers() as timers:  # the host's part: the sampler's own work is the device's
            timers.wrap(sampler_module, "sample_ref", "sampler (device work)")
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            host[overlap] = (time.perf_counter() - t0
                             - timers.seconds["sampler (device work)"]) / steps
    engine.async_scheduling = False
    engine.step()  # reads the last tokens in flight
    # Then each phase: the timers cost ~0.5 us a call, and _take and _output are called per
    # row, so they run apart from the total above.
    with Timers() as timers:
        timers.wrap(engine.scheduler, "schedule", "schedule")
        timers.wrap(engine.runner, "prepare", "prepare inputs")
        timers.wrap(engine.sampler, "columns", "sampler metadata")
        timers.wrap(engine.sampler, "send", "sampler metadata")
        timers.wrap(engine.scheduler, "update_after_step", "update (prefix cache)")
        timers.wrap(sampler_module, "sample_ref", "sampler (device work)")
        timers.wrap(engine.sampler, "fetch", "fetch samples")
        timers.wrap(engine, "_output", "outputs")
        timers.wrap(engine, "_take", "take tokens")
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t0
    out = {k: v / steps * 1000 for k, v in timers.seconds.items()}
    wrapped = total / steps * 1000 - out.pop("sampler (device work)", 0.0)
    out["rest"] = wrapped - sum(out.get(k, 0.0) for k in PHASES[3:-1])  # and the timers' cost
    out["host"], out["host (async)"] = host[False] * 1000, host[True] * 1000
    out["host (mixed)"] = mixed_step_ms(engine, rng, params, steps)
    return out


def mixed_step_ms(engine: LLMEngine, rng, params: SamplingParams, steps: int) -> float:
    """The host's part of a step that brings a 100-token prompt beside the batch (the step
    after every arrival: its rows take the general path, a prompt chunk among decode rows);
    the prompt's one token ends its reply."""
    seconds = 0.0
    with Timers() as timers:
        timers.wrap(sampler_module, "sample_ref", "sampler (device work)")
        for i in range(steps):
            engine.add_request(engine.make_request(f"m{i}", EngineRequest(
                rng.integers(0, VOCAB, 100).tolist(), params,
                RequestOptions(max_tokens=1, ignore_eos=True))))
            t0 = time.perf_counter()
            engine.step()
            seconds += time.perf_counter() - t0
    return (seconds - timers.seconds["sampler (device work)"]) / steps * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,64,256")
    ap.add_argument("--context", default="1024,4096")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        loaded = tiny_model(Path(d))
        print(f"{'batch':>5} {'context':>7}  ms per step: " + ", ".join(PHASES), flush=True)
        for batch in [int(b) for b in args.batch.split(",")]:
            for context in [int(c) for c in args.context.split(",")]:
                ms = run(loaded, batch, context, args.steps)
                print(f"{batch:5d} {context:7d}  " + "  ".join(
                    f"{ms.get(k, 0.0):6.3f}" for k in PHASES), flush=True)


if __name__ == "__main__":
    main()
