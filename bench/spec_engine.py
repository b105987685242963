"""Speculative decoding in the engine alone (no server): decode tok/s and time a step, without
and with n-gram drafting, on kiln/bench/spec_prompts.py's workloads.

    .venv/bin/python bench/spec_engine.py --workloads editing,free --k 4
    .venv/bin/python bench/spec_engine.py --model qwen2.5-coder:0.5b --k 2,4

Each setting reads the same prompts greedily with the penalties off, `--streams` at a time,
to the end of the reply or `max_tokens`, and counts the replies equal (token ids) to those
without drafting, as they must be; the
first token (the prefill's) is left out of the timing. The settings run in turn in one
process, `--rounds` times with the order reversed every other round, so a shared machine's
drift falls on all of them: the median of the rounds' ratios is the figure to quote.
"""

from __future__ import annotations

import argparse
import statistics
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


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, streams: int = 1,
        by_tokens: dict[int, list[float]] | None = None
        ) -> tuple[int, int, int, float, list[list[int]]]:
    """(tokens after the first, steps, row-steps (the unfinished rows of each step, summed),
    seconds, the replies) over the prompts, `streams` at a time: each group is prefilled (with
    its first tokens) before the timing starts. by_tokens, where given, gathers each timed
    step's seconds under the tokens it read (its rows and the drafts they checked)."""
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
            rows = sum(not req.is_finished for req in reqs)
            drafted, start = engine.num_draft_tokens, time.perf_counter()
            engine.step()
            if by_tokens is not None:
                by_tokens.setdefault(rows + engine.num_draft_tokens - drafted, []).append(
                    time.perf_counter() - start)
            row_steps += rows
            steps += 1
        seconds += time.perf_counter() - t
        tokens += sum(req.num_output_tokens for req in reqs) - first
        replies += [req.output_token_ids for req in reqs]
    return tokens, steps, row_steps, seconds, replies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--workloads", default="editing,quoting,free")
    ap.add_argument("--k", default=str(SpeculativeConfig().num_speculative_tokens),
                    help="--num-speculative-tokens values to try")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--streams", type=int, default=1, help="requests decoded together")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds over the settings, each in turn, alternating the order")
    ap.add_argument("--ngram-min", type=int, default=SpeculativeConfig().ngram_min)
    ap.add_argument("--ngram-max", type=int, default=SpeculativeConfig().ngram_max)
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="as kiln serve's --speculative-disable-by-batch-size (default: the "
                         "device's)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--by-tokens", action="store_true",
                    help="also the median step by the tokens it read (rows and drafts)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="as kiln serve's (auto on the CPU: 8-bit activations, fp16 KV cache)")
    args = ap.parse_args()
    model, _ = build_engine(args.model, EngineOptions(dtype=args.dtype, kv_cache_tokens=16384))
    settings = [None] + [SpeculativeConfig(num_speculative_tokens=int(k),
                                           ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                                           disable_by_batch_size=args.disable_by_batch_size)
                         for k in args.k.split(",")]
    print(f"{args.model} --dtype {args.dtype}: {args.prompts} prompts a workload, "
          f"{args.max_tokens} tokens each, {args.streams} at a time, "
          f"ngram {args.ngram_min}..{args.ngram_max}, {args.rounds} rounds")
    for kind in args.workloads.split(","):
        prompts = [model.chat_prompt_ids(spec_prompt(kind, i, 0)) for i in range(args.prompts)]
        engines = []
        for spec in settings:
            engine = LLMEngine(model, EngineConfig.build(
                model.ctx_len, model.max_prefill_len, kv_cache_tokens=16384, speculative=spec))
            run(engine, prompts[:args.streams], 8, args.streams)  # warm-up
            engines.append(engine)
        # per setting: each round's tok/s, and its counts and replies (the same every round)
        rates: list[list[float]] = [[] for _ in settings]
        steps_by_tokens: list[dict[int, list[float]]] = [{} for _ in settings]
        counts: list[tuple[int, int, int, float, list[list[int]]]] = [None] * len(settings)
        for r in range(args.rounds):
            order = range(len(settings)) if r % 2 == 0 else reversed(range(len(settings)))
            for i in order:
                counts[i] = run(engines[i], prompts, args.max_tokens, args.streams,
                                steps_by_tokens[i])
                rates[i].append(counts[i][0] / counts[i][3])
        plain = counts[0][4]
        for spec, rate, by_tokens, (tokens, steps, row_steps, seconds, replies) in zip(
                settings, rates, steps_by_tokens, counts, strict=True):
            ratio = statistics.median(a / b for a, b in zip(rate, rates[0], strict=True))
            same = sum(a == b for a, b in zip(replies, plain))
            k = spec.num_speculative_tokens if spec else 0
            print(f"{kind:8} k={k}  {statistics.median(rate):6.1f} tok/s ({ratio:.2f}x)  "
                  f"{1000 * seconds / steps:5.1f} ms a step  "
                  f"{tokens / row_steps:.2f} tokens a row a step  "
                  f"replies as without drafting: {same}/{len(prompts)}",
                  flush=True)
            if args.by_tokens:
                print("    a step by the tokens it read: " + ", ".join(
                    f"{n}: {1000 * statistics.median(ts):.1f} ms ({len(ts)})"
                    for n, ts in sorted(by_tokens.items())), flush=True)


if __name__ == "__main__":
    main()
