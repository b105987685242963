"""Drafting settings replayed on recorded greedy replies, without the model: the tokens a step
and the step time each setting of the n-gram drafter would give.

    .venv/bin/python bench/spec_replay.py --k 4,8 --ngram 3-4,2-8
    .venv/bin/python bench/spec_replay.py --model qwen2.5-coder:0.5b --row-cost 0.19

A greedy reply with penalties off is the same with and without drafting, so once a workload's
replies are generated (without drafting), any setting can be replayed on them exactly: at each
step kiln's own drafter and pace (runtime/drafting) propose, the draft is kept up to its first
token that differs from the reply, and the step yields the kept tokens and one more. A step that
reads n tokens costs 1 + row_cost * (n - 1) steps of one token (bench/spec_engine.py --by-tokens
measures it: 0.18 for smollm2:135m and 0.19 for qwen2.5-coder:0.5b on the 2-core AMD host); the
modelled speed-up is the tokens over the summed costs. It ranks settings in seconds where the
engine takes minutes a setting; bench/spec_engine.py and bench/spec.sh measure the one chosen.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spec_engine import run  # noqa: E402  (beside this file)

from kiln.bench.spec_prompts import spec_prompt  # noqa: E402
from kiln.runtime.drafting.ngram import NgramIndex  # noqa: E402
from kiln.runtime.drafting.pace import DraftPace  # noqa: E402
from kiln.runtime.engine.bootstrap import EngineOptions, build_engine  # noqa: E402
from kiln.runtime.engine.config import EngineConfig  # noqa: E402
from kiln.runtime.engine.llm_engine import LLMEngine  # noqa: E402


def replies(model, kind: str, prompts: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy reply ids) of the workload's first `prompts` distinct prompts."""
    ids: list[list[int]] = []
    for i in range(64):
        p = model.chat_prompt_ids(spec_prompt(kind, i, 0))
        if p not in ids:
            ids.append(p)
        if len(ids) == prompts:
            break
    engine = LLMEngine(model, EngineConfig.build(model.ctx_len, model.max_prefill_len,
                                                 kv_cache_tokens=16384))
    return list(zip(ids, run(engine, ids, max_tokens, streams=len(ids))[4]))


def replay(prompt: list[int], reply: list[int], max_tokens: int, k: int, ngram: tuple[int, int],
           row_cost: float) -> tuple[int, int, float]:
    """(tokens after the first, steps, cost in one-token steps) of drafting the reply, whose
    request asked for max_tokens (what limits a draft, as in the engine)."""
    text, index, pace = prompt + reply[:1], NgramIndex(*ngram), DraftPace(k)
    at, steps, cost = 1, 0, 0.0
    while at < len(reply):
        length = min(pace.next_length(), max_tokens - at - 1)
        draft = index.propose(text, length) if length > 0 else []
        kept = 0
        while kept < len(draft) and at + kept < len(reply) and draft[kept] == reply[at + kept]:
            kept += 1
        pace.record(len(draft), kept)
        text += reply[at:at + kept + 1]
        at += kept + 1
        steps += 1
        cost += 1 + row_cost * len(draft)
    return len(reply) - 1, steps, cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--workloads", default="editing,quoting,free")
    ap.add_argument("--prompts", type=int, default=6, help="distinct prompts a workload, at most")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--k", default="4,8", help="--num-speculative-tokens values")
    ap.add_argument("--ngram", default="3-4,2-8", help="--ngram-min-max pairs")
    ap.add_argument("--row-cost", type=float, default=0.18,
                    help="a step's extra cost per token read past one, in one-token steps")
    args = ap.parse_args()
    model, _ = build_engine(args.model, EngineOptions(dtype="auto", kv_cache_tokens=16384))
    settings = [(int(k), tuple(map(int, n.split("-"))))
                for k in args.k.split(",") for n in args.ngram.split(",")]
    print(f"{args.model}: greedy replies of {args.max_tokens} tokens at most, a step reading n "
          f"tokens costs 1 + {args.row_cost} (n - 1)")
    for kind in args.workloads.split(","):
        recorded = replies(model, kind, args.prompts, args.max_tokens)
        for k, ngram in settings:
            tokens = steps = 0
            cost = 0.0
            for prompt, reply in recorded:
                t, s, c = replay(prompt, reply, args.max_tokens, k, ngram, args.row_cost)
                tokens, steps, cost = tokens + t, steps + s, cost + c
            print(f"{kind:8} ({len(recorded)} replies)  k={k:<2} ngram {ngram[0]}-{ngram[1]}  "
                  f"{tokens / steps:.2f} tokens a step  modelled {tokens / cost:.2f}x", flush=True)


if __name__ == "__main__":
    main()
