"""Speculative decoding in the engine alone (no server): decode tok/s and time a step, without
and with n-gram drafting, on kiln/bench/spec_prompts.py's workloads.

    .venv/bin/python bench/spec_engine.py --workloads editing,free --k 4
    .venv/bin/python bench/spec_engine.py --model qwen2.5-coder:0.5b --k 2,4

Each setting reads the same prompts greedily with the penalties off, `--streams` at a time,
to the end of the reply or `max_tokens`, and counts the replies equal (token ids) to those
without drafting, as they must be; the
first token (the prefill's) is left out of the timing. The settings run in turn in one
process, so their ratio is the figure to quote.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln.bench.spec_prompts import spec_prompt  # noqa: E402
from kiln.runtime.drafting.config import SpeculativeConfig  # noqa: E402
from kiln.runtime.engine.bootstrap import EngineOptions, build_engine  # noqa: E402
from kiln.runtime.engine.config import EngineConfig  # noqa: E402
from kiln.runtime.engine.engine_request import EngineRequest, RequestOptions  # noqa: E402
from kiln.runtime.engine.llm_engine import LLMEngine  # noqa: E402
from kiln.runtime.sampling.params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0)


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, streams: int = 1
        ) -> tuple[int, int, int, float, list[list[int]]]:
    """(tokens after the first, steps, row-steps (the unfinished rows of each step, summed),
    seconds, the replies) over the prompts, `streams` at a time: each group is prefilled (with
    its first tokens) before the timing starts."""
    tokens = steps = row_steps = 0
    seconds = 0.0
    replies = []
    for g in range(0, len(prompts), streams):
        reqs = [engine.make_request(f"r{i}", EngineRequest(
            ids, GREEDY, RequestOptions(max_tokens=max_tokens)))
            for i, ids in enumerate(prompts[g:g + streams], start=g)]
        for req in reqs:
            engine.add_request(req)
        while any(not req.output_token_ids for req in reqs):
            engine.step()  # the prefills and the first tokens
        first = sum(req.num_output_tokens for req in reqs)
        t = time.perf_counter()
        while engine.has_unfinished():
            row_steps += sum(not req.is_finished for req in reqs)
            engine.step()
            steps += 1
        seconds += time.perf_counter() - t
        tokens += sum(req.num_output_tokens for req in reqs) - first
        replies += [req.output_token_ids for req in reqs]
    return tokens, steps, row_steps, seconds, replies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--workloads", default="editing,quoting,free")
    ap.add_argument("--k", default="4", help="--num-speculative-tokens values to try")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--streams", type=int, default=1, help="requests decoded together")
    ap.add_argument("--ngram-min", type=int, default=SpeculativeConfig().ngram_min)
    ap.add_argument("--ngram-max", type=int, default=SpeculativeConfig().ngram_max)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="as kiln serve's (auto on the CPU: 8-bit activations, fp16 KV cache)")
    args = ap.parse_args()
    model, _ = build_engine(args.model, EngineOptions(dtype=args.dtype, kv_cache_tokens=16384))
    settings = [None] + [SpeculativeConfig(num_speculative_tokens=int(k),
                                           ngram_min=args.ngram_min, ngram_max=args.ngram_max)
                         for k in args.k.split(",")]
    print(f"{args.model} --dtype {args.dtype}: {args.prompts} prompts a workload, "
          f"{args.max_tokens} tokens each, {args.streams} at a time, "
          f"ngram {args.ngram_min}..{args.ngram_max}")
    for kind in args.workloads.split(","):
        prompts = [model.chat_prompt_ids(spec_prompt(kind, i, 0)) for i in range(args.prompts)]
        base = plain = None
        for spec in settings:
            config = EngineConfig.build(model.ctx_len, model.max_prefill_len,
                                        kv_cache_tokens=16384, speculative=spec)
            engine = LLMEngine(model, config)
            run(engine, prompts[:args.streams], 8, args.streams)  # warm-up
            tokens, steps, row_steps, seconds, replies = run(engine, prompts, args.max_tokens,
                                                  args.streams)
            rate = tokens / seconds
            base, plain = base or rate, plain or replies
            same = sum(a == b for a, b in zip(replies, plain))
            k = spec.num_speculative_tokens if spec else 0
            print(f"{kind:8} k={k}  {rate:6.1f} tok/s ({rate / base:.2f}x)  "
                  f"{1000 * seconds / steps:5.1f} ms a step  "
                  f"{tokens / row_steps:.2f} tokens a row a step  "
                  f"replies as without drafting: {same}/{len(prompts)}",
                  flush=True)


if __name__ == "__main__":
    main()
