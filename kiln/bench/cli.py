"""`kiln bench`: the subcommand's flags and what it does with them.

    kiln bench --base-url URL [--model NAME] --prompts short,long --concurrency 1,16,64
    kiln bench --compare A.json B.json        # ratios of A's label over B's
    kiln bench --plot A.json B.json --chart both.png
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

from kiln.bench.chart import ChartUnavailable, plot
from kiln.bench.client import BenchError, open_client, served_model
from kiln.bench.config import BenchConfig
from kiln.bench.prompts import PROMPT_SETS
from kiln.bench.record import load_results, write_results
from kiln.bench.report import compare_table, summary_table
from kiln.bench.runner import run_bench


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="benchmark any OpenAI-compatible server (kiln, vLLM, llama-server, ...)",
        description="Streaming chat requests at several concurrency levels against an "
                    "OpenAI-compatible base URL: TTFT, TPOT, ITL, output tokens/s per level, a "
                    "table, a JSON file and a chart.")
    p.add_argument("--base-url", default="http://127.0.0.1:52625/v1", help="ends in /v1")
    p.add_argument("--model", default=None,
                   help="sent as each request's model (default: the model the server lists "
                        "as loaded, else the first it lists)")
    p.add_argument("--label", default=None,
                   help="the server's name in results and charts (default: host:port)")
    p.add_argument("--prompts", default="short", help=f"sets: {', '.join(PROMPT_SETS)}")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per level (default: max(8, 2 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--long-tokens", type=int, default=2000,
                   help="words (about tokens) in a long or shared-prefix prompt")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per prompt set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (by default it is sent where the server takes "
                        "it, so every reply is --max-tokens long on every server)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "bench"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--out", help="results JSON (default: LABEL.json here)")
    p.add_argument("--chart", help="PNG chart (default: the JSON path with .png)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no table")
    p.add_argument("--plot", nargs="+", metavar="JSON", help="merge result files into --chart")
    p.add_argument("--compare", nargs="+", metavar="JSON",
                   help="ratios of the first label over the second, from result files")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    if args.compare or args.plot:
        return _from_files(args)
    base_url = args.base_url.rstrip("/")
    try:
        model = args.model or asyncio.run(_served_model(base_url, args.api_key))
        cfg = BenchConfig(
            base_url=base_url, label=args.label or urlsplit(base_url).netloc or base_url,
            model=model, prompt_sets=tuple(s.strip() for s in args.prompts.split(",")
                                           if s.strip()),
            concurrency=tuple(int(c) for c in args.concurrency.split(",") if c.strip()),
            num_requests=args.requests, max_tokens=args.max_tokens,
            long_tokens=args.long_tokens, warmup=args.warmup, seed=args.seed,
            timeout=args.timeout, ignore_eos=args.ignore_eos)
    except ValueError as exc:
        print(f"kiln bench: {exc}", file=sys.stderr)
        return 2
    except BenchError as exc:
        print(f"kiln bench: {exc}", file=sys.stderr)
        return 1
    try:
        run = asyncio.run(run_bench(cfg, args.api_key, args.quiet))
    except BenchError as exc:
        print(f"kiln bench: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out or f"{re.sub(r'[^A-Za-z0-9._-]', '_', cfg.label)}.json")
    write_results(run, out)
    if not args.quiet:
        print(summary_table(run))
        print(f"[bench]  results in {out}")
    try:
        plot(load_results([str(out)]), Path(args.chart) if args.chart
             else out.with_suffix(".png"))
    except ChartUnavailable as exc:
        print(f"[bench]  no chart: {exc}", file=sys.stderr)
    failed = [r["error"] for lv in run.levels for r in lv.requests if r["error"]]
    if failed:
        print(f"kiln bench: {len(failed)} request(s) failed, first: {failed[0]}",
              file=sys.stderr)
    return 1 if failed else 0


async def _served_model(base_url: str, api_key: str) -> str:
    async with open_client(base_url, api_key, 1, 30.0) as client:
        return await served_model(client)


def _from_files(args) -> int:
    try:
        if args.compare:
            print(compare_table(load_results(args.compare)))
        if args.plot:
            plot(load_results(args.plot), Path(args.chart or "bench.png"))
    except (ValueError, ChartUnavailable) as exc:
        print(f"kiln bench: {exc}", file=sys.stderr)
        return 1
    return 0
