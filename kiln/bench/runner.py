"""Each prompt set at each concurrency level, at most `concurrency` requests in flight."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

from tqdm import tqdm

from kiln.bench.client import IgnoreEos, open_client, probe_ignore_eos, run_request
from kiln.bench.config import BenchConfig
from kiln.bench.prompts import make_prompt, warmups
from kiln.bench.results import LevelResult, RequestResult, level_result
from kiln.bench.spec_prompts import NEUTRAL_PENALTIES, SPEC_SETS


@dataclass
class BenchRun:
    config: BenchConfig
    ignore_eos: IgnoreEos
    levels: list[LevelResult]


def bodies(cfg: BenchConfig, kind: str, indices: range, ignore_eos: bool) -> list[dict]:
    """The request bodies of prompts `indices` of set `kind`: greedy, streamed, with usage."""
    base = {"model": cfg.model, "max_tokens": cfg.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        base["ignore_eos"] = True
    if kind in SPEC_SETS:
        # Drafting's workloads turn penalties off, so a reply is the same with and without
        # it (greedy): the two runs do the same work.
        base.update(NEUTRAL_PENALTIES)
    return [{**base, "messages": make_prompt(kind, i, cfg.seed, cfg.long_tokens)}
            for i in indices]


async def run_batch(client, bodies: list[dict], concurrency: int, bar: tqdm
                    ) -> tuple[list[RequestResult], float]:
    """Send `bodies` with at most `concurrency` in flight; the results and the wall time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(body):
        async with sem:
            r = await run_request(client, body)
        bar.update(1)
        return r

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(b) for b in bodies))
    return list(results), time.perf_counter() - t0


def level_line(lv: LevelResult) -> str:
    return (f"[bench]  {lv.prompt_set} c={lv.concurrency}: {lv.num_requests} requests "
            f"({lv.errors} failed), {lv.request_throughput:.2f} req/s, "
            f"{lv.output_throughput:.1f} output tok/s, TTFT p50/p99 {lv.ttft.p50:.3f}/"
            f"{lv.ttft.p99:.3f} s, TPOT p50 {1000 * lv.tpot.p50:.1f} ms, "
            f"{lv.prompt_tokens} prompt tokens ({lv.cached_tokens} cached)")


async def run_bench(cfg: BenchConfig, api_key: str, quiet: bool = False) -> BenchRun:
    """Request indices never repeat within a set, so a level never finds the previous level's
    prompts in a prefix cache. Raises BenchError when the server does not answer the probe."""
    total = sum(warmups(kind, cfg.warmup) + sum(map(cfg.requests_at, cfg.concurrency))
                for kind in cfg.prompt_sets)
    levels = []
    async with open_client(cfg.base_url, api_key, max(cfg.concurrency) + 4,
                           cfg.timeout) as client:
        ignore_eos = await probe_ignore_eos(client, cfg.model) if cfg.ignore_eos else \
            IgnoreEos(False, "ignore_eos not sent (--no-ignore-eos): replies end where the "
                             "model stops")
        if not quiet:
            print(f"[bench]  {cfg.label}: {ignore_eos.note}", file=sys.stderr)
        with tqdm(total=total, desc=cfg.label, unit="req", file=sys.stderr,
                  disable=quiet) as bar:
            for kind in cfg.prompt_sets:
                # Warm-up requests use negative indices: never a measured prompt.
                bar.set_postfix_str(f"{kind} warm-up")
                warm = range(-warmups(kind, cfg.warmup), 0)
                await run_batch(client, bodies(cfg, kind, warm, ignore_eos.sent), 1, bar)
                index = 0
                for c in cfg.concurrency:
                    n = cfg.requests_at(c)
                    batch = bodies(cfg, kind, range(index, index + n), ignore_eos.sent)
                    index += n
                    bar.set_postfix_str(f"{kind} c={c}")
                    results, wall = await run_batch(client, batch, c, bar)
                    levels.append(level_result(kind, c, results, wall))
                    if not quiet:
                        bar.write(level_line(levels[-1]), file=sys.stdout)
    return BenchRun(cfg, ignore_eos, levels)
