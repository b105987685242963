"""Time the engine's decode step at several batch sizes, and a cold prefill (no server).

    .venv/bin/python bench/decode_step.py --batch 1,16,64 --context 300 --steps 32
    .venv/bin/python bench/decode_step.py --batch "" --prefill 2000

Each batch runs `batch` requests of `context` prompt tokens (greedy, or sampled as
`--temperature`, `--top-p` and `--top-k` say), prefills them, then times `steps` decode
steps of the whole batch. The requests that finish their prefill first decode while the
others prefill, so each may write a token a prefill step: their `max_tokens` leaves room
for those, every row runs through every timed step, and they are aborted after it (the
tokens a second are counted, not assumed). `--prefill N` times reading one N-token
prompt cold, in the engine's chunks, to its first token. The model loads as `kiln serve`
loads it (`--dtype`). Compare two trees by running this file from each in the same session,
alternating: the machine is shared, so only ratios mean anything.

`--breakdown` also prints where each timed step went, in ms per step: every layer's four
products, the norms, RoPE, the gated activation and attention (timed around the backend's
calls, so Python's own share is in "rest of forward"), the forward, and the whole step
(LM head, sampler and scheduler being the step less the forward).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln.runtime.engine.bootstrap import EngineOptions, build_engine  # noqa: E402
from kiln.runtime.engine.engine_request import EngineRequest, RequestOptions  # noqa: E402
from kiln.runtime.sampling.params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--context", type=int, default=300, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2, help="timed rounds per batch size")
    ap.add_argument("--prefill", type=int, default=0, help="also time a cold N-token prefill")
    ap.add_argument("--breakdown", action="store_true", help="time the step's parts too")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the requests' sampling (default greedy); with --top-p, --top-k")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="as kiln serve's (auto on the CPU: 8-bit activations, fp16 KV cache)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",") if b]
    # a token a prefill step at most: a step prefills at least one chunk of 256 tokens
    ahead = max([*batches, 1]) * args.context // 256 + 2
    kv_tokens = max([*batches, 1]) * (args.context + args.steps + ahead + 32) * (args.repeat + 1)
    loaded, engine = build_engine(args.model, EngineOptions(
        dtype=args.dtype, kv_cache_tokens=max(kv_tokens, args.prefill * (args.repeat + 1) + 64),
        max_num_seqs=max([*batches, 1])))
    vocab = loaded.config.vocab_size
    parts = timers(loaded.model) if args.breakdown else None
    n = 0
    for batch in batches:
        for round_ in range(args.repeat):
            reqs = []
            for _ in range(batch):
                n += 1
                prompt = [(n * 7919 + i * 104729) % (vocab - 1000) + 500
                          for i in range(args.context)]
                reqs.append(engine.make_request(f"b{n}", EngineRequest(
                    prompt, SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                           top_k=args.top_k, seed=n),
                    RequestOptions(max_tokens=args.steps + ahead + 1, ignore_eos=True))))
            for r in reqs:
                engine.add_request(r)
            while any(r.num_output_tokens == 0 for r in reqs):  # prefill
                engine.step()
            if parts is not None:
                parts.clear()
            before = sum(r.num_output_tokens for r in reqs)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            dt = (time.perf_counter() - t0) / args.steps
            rows = (sum(r.num_output_tokens for r in reqs) - before) / args.steps
            for r in reqs:
                engine.abort(r.request_id)
            print(f"[decode_step]  batch {batch:3d} round {round_}: {dt * 1e3:8.1f} ms/step, "
                  f"{rows / dt:7.1f} tok/s ({rows:g} rows a step)", flush=True)
            if parts is not None:
                ms = {k: v / args.steps * 1e3 for k, v in parts.items()}
                ms["rest of forward"] = ms["forward"] - sum(
                    v for k, v in ms.items() if k != "forward")
                ms["step less forward"] = dt * 1e3 - ms["forward"]
                print("               " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))
    for round_ in range(args.repeat if args.prefill else 0):
        n += 1
        prompt = [(n * 7919 + i * 104729) % (vocab - 1000) + 500 for i in range(args.prefill)]
        req = engine.make_request(f"p{n}", EngineRequest(
            prompt, SamplingParams(temperature=0.0),
            RequestOptions(max_tokens=1, ignore_eos=True)))
        engine.add_request(req)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        dt = time.perf_counter() - t0
        print(f"[decode_step]  prefill {args.prefill} tokens round {round_}: {dt:6.2f} s, "
              f"{args.prefill / dt:7.1f} tok/s", flush=True)


def timers(model) -> collections.Counter:
    """Wrap the model's per-layer calls in timers; the returned counter sums seconds."""
    seconds: collections.Counter = collections.Counter()
    running: list[str] = []  # a call made inside another timed call counts as the outer's

    def timed(fn, key):
        def call(*args, **kwargs):
            if len(running) > 1:  # inside forward and another timed call
                return fn(*args, **kwargs)
            running.append(key)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - t
                running.pop()
        return call

    model.forward = timed(model.forward, "forward")
    # attention includes its QK-norm, RoPE and KV store; add_rms_norm the residual's add
    for name in ("rms_norm", "add_rms_norm", "rms_norm_heads_", "rope_", "act_mul",
                 "attention"):
        setattr(model.backend, name, timed(getattr(model.backend, name), name))
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(layer, name, timed(getattr(layer, name), name))
    return seconds


if __name__ == "__main__":
    main()
