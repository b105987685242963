"""Serving benchmark: streaming chat requests at several concurrency levels against any
OpenAI-compatible base URL (kiln, llama.cpp's `python -m llama_cpp.server`, ...).

Per request: TTFT (to the first non-empty content chunk), TPOT = (e2e - ttft) / (n_out - 1)
and the inter-token latencies between content chunks. Output tokens come from `usage` when
the server sends it (`stream_options.include_usage`), else from the content chunks' count.
`--plot` merges result files into one chart; `--compare A.json B.json` prints A / B ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from spec_prompts import NEUTRAL_PENALTIES, SPEC_SETS, spec_prompt
from tqdm import tqdm

PROMPT_SETS = ("short", "long", "shared-prefix", "prefixes", *SPEC_SETS)
NUM_PREFIXES = 4  # the `prefixes` set: requests cycle through this many long prefixes
SHORT_PROMPTS = [
    "What is the capital of France?", "Name three primary colours.", "Why is the sky blue?",
    "Write a haiku about the sea.", "Explain what a CPU cache is in two sentences.",
    "Give me a synonym for 'happy'.", "How many legs does a spider have?",
    "What does HTTP stand for?", "Suggest a name for a grey cat.", "What is 17 times 3?",
    "List four fruits that are red.", "Translate 'good morning' into Spanish.",
    "Describe a rainy day in one sentence.", "What is the boiling point of water?",
    "Write a short greeting for a birthday card.", "Who wrote Romeo and Juliet?"]
# Common English words, one token each (with their leading space) in SmolLM2's vocabulary.
WORDS = """time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work number night
point home water room mother area money story fact month lot right study book eye job word issue
side kind head house service friend father power hour game line end member law car city name team
minute idea kid body back parent face level office door health person art war history party music
""".split()


@dataclass
class BenchConfig:
    base_url: str
    label: str
    model: str
    prompt_sets: list[str]
    concurrency: list[int]
    num_requests: int  # per level; 0 = max(8, 2 * concurrency)
    max_tokens: int
    long_tokens: int
    warmup: int
    seed: int
    timeout: float

    def __post_init__(self) -> None:
        if bad := [s for s in self.prompt_sets if s not in PROMPT_SETS]:
            raise ValueError(f"unknown prompt set {bad}; choose from {', '.join(PROMPT_SETS)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency levels must be positive integers")
        if self.max_tokens < 1 or self.long_tokens < 1 or self.num_requests < 0:
            raise ValueError("--max-tokens and --long-tokens must be >= 1, --requests >= 0")

    def requests_at(self, concurrency: int) -> int:
        return self.num_requests or max(8, 2 * concurrency)


@dataclass
class RequestResult:
    ttft: float = 0.0  # seconds to the first non-empty content chunk
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0
    content_chunks: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    def row(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "itl"} | {"tpot": self.tpot}


@dataclass
class Summary:
    mean: float
    p50: float
    p99: float


@dataclass
class LevelResult:
    prompt_set: str
    concurrency: int
    num_requests: int
    errors: int
    wall_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s over the level's wall time
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    prefill_tps: float  # sum(prompt_tokens) / sum(ttft): prompt tokens per second of TTFT
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2e: Summary
    requests: list[dict]  # per request: ttft, e2e, tpot, output/prompt/cached tokens, error


def make_prompt(kind: str, index: int, cfg: BenchConfig) -> list[dict]:
    """The chat messages of request `index` of a prompt set: the same for the same seed."""
    rng = random.Random(f"{cfg.seed}:{kind}:{index}")
    words = lambda r, n: " ".join(r.choice(WORDS) for _ in range(n))
    if kind in SPEC_SETS:
        return spec_prompt(kind, index, cfg.seed)
    if kind == "short":
        order = random.Random(cfg.seed).sample(SHORT_PROMPTS, len(SHORT_PROMPTS))
        text = order[index % len(order)]
    elif kind == "long":  # different from its first word on, so no prefix is shared
        text = f"Text {index}: {words(rng, cfg.long_tokens)}\n\nSummarize the text above."
    else:  # shared-prefix: one long prefix for all requests, a different question each;
        # prefixes: request i has long prefix i % NUM_PREFIXES (several users' documents)
        which = index % NUM_PREFIXES if kind == "prefixes" else ""
        prefix = words(random.Random(f"{cfg.seed}:prefix{which}"), cfg.long_tokens)
        text = f"{prefix}\n\nQuestion {index}: which of these words is about {words(rng, 3)}?"
    return [{"role": "user", "content": text}]


async def run_request(client: httpx.AsyncClient, cfg: BenchConfig, messages: list[dict],
                      extra: dict | None = None) -> RequestResult:
    body = {"model": cfg.model, "messages": messages, "max_tokens": cfg.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **(extra or {})}
    res, usage, last = RequestResult(), None, 0.0
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                res.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                usage = chunk.get("usage") or usage
                choice = (chunk.get("choices") or [{}])[0]
                delta = choice.get("delta") or {}
                if not (delta.get("content") or delta.get("reasoning_content")):
                    if choice.get("finish_reason") and res.content_chunks == 0:
                        # The reply ended before any text (a stop token first): the prompt
                        # was still read, so the end marks the first token's time.
                        res.ttft = time.perf_counter() - t0
                    continue
                now = time.perf_counter() - t0
                if res.content_chunks == 0:
                    res.ttft = now
                else:
                    res.itl.append(now - last)
                last, res.content_chunks = now, res.content_chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.e2e = time.perf_counter() - t0
    if res.content_chunks == 0 and res.ttft == 0.0 and res.error is None:
        res.error = "no content in the response"
    usage = usage or {}
    res.output_tokens = usage.get("completion_tokens") or res.content_chunks
    res.prompt_tokens = usage.get("prompt_tokens") or 0
    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return res


async def run_batch(client, cfg: BenchConfig, prompts: list[list[dict]], concurrency: int,
                    bar: tqdm, extra: dict | None = None) -> tuple[list[RequestResult], float]:
    """Send `prompts` with at most `concurrency` in flight; the results and the wall time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(messages):
        async with sem:
            r = await run_request(client, cfg, messages, extra)
        bar.update(1)
        return r

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(m) for m in prompts))
    return list(results), time.perf_counter() - t0


def summarize(xs: list[float]) -> Summary:
    """Mean, p50 and p99 (linear interpolation between ranks, as numpy); zeros for no data."""
    s = sorted(xs) or [0.0]

    def pct(q: float) -> float:
        k = (len(s) - 1) * q / 100
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return Summary(sum(s) / len(s), pct(50), pct(99))


def level_result(kind: str, concurrency: int, results: list[RequestResult], wall: float
                 ) -> LevelResult:
    ok = [r for r in results if r.error is None]
    out, prompt = sum(r.output_tokens for r in ok), sum(r.prompt_tokens for r in ok)
    ttft_sum = sum(r.ttft for r in ok)
    return LevelResult(
        prompt_set=kind, concurrency=concurrency, num_requests=len(results),
        errors=len(results) - len(ok), wall_s=wall, request_throughput=len(ok) / wall,
        output_throughput=out / wall, output_tokens=out, prompt_tokens=prompt,
        cached_tokens=sum(r.cached_tokens for r in ok),
        prefill_tps=prompt / ttft_sum if ttft_sum > 0 else 0.0,
        ttft=summarize([r.ttft for r in ok]),
        tpot=summarize([r.tpot for r in ok if r.tpot is not None]),
        itl=summarize([x for r in ok for x in r.itl]), e2e=summarize([r.e2e for r in ok]),
        requests=[r.row() for r in results])


def warmups(kind: str, cfg: BenchConfig) -> int:
    """Unmeasured requests first: for `prefixes`, at least one per prefix (each in a cache)."""
    return max(cfg.warmup, NUM_PREFIXES) if kind == "prefixes" else cfg.warmup


async def run_bench(cfg: BenchConfig, quiet: bool = False) -> list[LevelResult]:
    """Each prompt set at each concurrency level; request indices never repeat within a set,
    so a level never finds the previous level's prompts in a prefix cache."""
    total = sum(warmups(kind, cfg) + sum(map(cfg.requests_at, cfg.concurrency))
                for kind in cfg.prompt_sets)
    # A connection per request: llama-server closes idle keep-alive connections, and a request
    # sent on one as it closes fails with no response; a loopback connect costs ~0.1 ms.
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 4, max_keepalive_connections=0)
    levels = []
    with tqdm(total=total, desc=cfg.label, unit="req", file=sys.stderr, disable=quiet) as bar:
        async with httpx.AsyncClient(base_url=cfg.base_url, limits=limits, timeout=cfg.timeout,
                                     headers={"Authorization": "Bearer bench"}) as client:
            for kind in cfg.prompt_sets:
                # Drafting's workloads turn penalties off, so a reply is the same with and
                # without it (greedy): the two runs do the same work.
                extra = NEUTRAL_PENALTIES if kind in SPEC_SETS else None
                # Warm-up requests use negative indices: never a measured prompt.
                warm = [make_prompt(kind, -1 - i, cfg) for i in range(warmups(kind, cfg))]
                bar.set_postfix_str(f"{kind} warm-up")
                await run_batch(client, cfg, warm, 1, bar, extra)
                index = 0
                for c in cfg.concurrency:
                    prompts = [make_prompt(kind, index + i, cfg) for i in range(cfg.requests_at(c))]
                    index += len(prompts)
                    bar.set_postfix_str(f"{kind} c={c}")
                    results, wall = await run_batch(client, cfg, prompts, c, bar, extra)
                    levels.append(level_result(kind, c, results, wall))
    return levels


def write_results(cfg: BenchConfig, levels: list[LevelResult], path: Path) -> None:
    machine = {"platform": platform.platform(), "machine": platform.machine(),
               "processor": platform.processor(), "python": platform.python_version(),
               "cpu_count": os.cpu_count()}
    doc = {"label": cfg.label, "model": cfg.model, "base_url": cfg.base_url,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine, "config": asdict(cfg), "levels": [asdict(lv) for lv in levels]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


def load_levels(paths: list[str]) -> dict[str, list[dict]]:
    """{label: levels}, merging files of the same label; labels in order of appearance."""
    merged: dict[str, list[dict]] = {}
    for p in paths:
        doc = json.loads(Path(p).read_text())
        merged.setdefault(doc["label"], []).extend(doc["levels"])
    return merged


def find_level(levels: list[dict], kind: str, concurrency: int) -> dict | None:
    return next((lv for lv in levels if lv["prompt_set"] == kind
                 and lv["concurrency"] == concurrency), None)


def plot(merged: dict[str, list[dict]], out: Path) -> None:
    """One row per prompt set: output tokens/s, TTFT p50 and TPOT p50 against concurrency,
    one line per server label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in PROMPT_SETS if any(lv["prompt_set"] == k
                                           for lvs in merged.values() for lv in lvs)]
    metrics = [("output tokens/s", lambda lv: lv["output_throughput"]),
               ("TTFT p50 (s)", lambda lv: lv["ttft"]["p50"]),
               ("TPOT p50 (ms)", lambda lv: 1000 * lv["tpot"]["p50"])]
    fig, axes = plt.subplots(len(kinds), 3, figsize=(13, 3.4 * len(kinds)), squeeze=False)
    for row, kind in zip(axes, kinds, strict=True):
        ticks = sorted({lv["concurrency"] for lvs in merged.values() for lv in lvs
                        if lv["prompt_set"] == kind})
        for ax, (name, get) in zip(row, metrics, strict=True):
            for label, levels in merged.items():
                pts = sorted((lv["concurrency"], get(lv)) for lv in levels
                             if lv["prompt_set"] == kind)
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(c) for c in ticks])
            ax.set(xlabel="concurrency", title=f"{kind}: {name}")
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def compare(merged: dict[str, list[dict]]) -> str:
    """The ratio table of the first label over the second (kiln / llama.cpp)."""
    if len(merged) < 2:
        raise SystemExit(f"--compare needs two server labels, found {list(merged)}")
    (a, la), (b, lb) = list(merged.items())[:2]
    pair = lambda kind, c: (find_level(la, kind, c), find_level(lb, kind, c))
    rows = []

    def row(name, va, vb, fmt="{:.1f}"):
        if va is not None and vb is not None:
            rows.append((name, fmt.format(va), fmt.format(vb), f"{va / vb:.2f}" if vb else "-"))

    def prefill(lv, other):  # a server without usage has no prompt count: the prompts match
        ttft_sum = lv["ttft"]["mean"] * (lv["num_requests"] - lv["errors"])
        return (lv["prompt_tokens"] or other["prompt_tokens"]) / ttft_sum if ttft_sum else None

    cold, cached = pair("long", 1), pair("shared-prefix", 1)
    if all(cold):
        row("prefill tok/s (long, c=1)", prefill(cold[0], cold[1]), prefill(cold[1], cold[0]))
    for c in sorted({lv["concurrency"] for lv in la if lv["prompt_set"] == "short"}):
        if all(levels := pair("short", c)):
            row(f"output tok/s (short, c={c})", *(lv["output_throughput"] for lv in levels))
    if all(cold) and all(cached):
        row("TTFT p50 cold (long, c=1) s", *(lv["ttft"]["p50"] for lv in cold), "{:.3f}")
        row("TTFT p50 cached (shared-prefix, c=1) s", *(lv["ttft"]["p50"] for lv in cached),
            "{:.3f}")
        row("TTFT cold / cached", *(x["ttft"]["p50"] / max(y["ttft"]["p50"], 1e-9)
                                    for x, y in zip(cold, cached, strict=True)), "{:.2f}")
        rows.append(("cached tokens (shared-prefix, c=1)",
                     *(str(lv["cached_tokens"]) for lv in cached), ""))
    head = ("metric", a, b, f"{a} / {b}")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                     for r in [head, *rows])


def print_levels(levels: list[LevelResult]) -> None:
    for lv in levels:
        print(f"[bench]  {lv.prompt_set} c={lv.concurrency}: {lv.num_requests} requests "
              f"({lv.errors} failed), {lv.request_throughput:.2f} req/s, "
              f"{lv.output_throughput:.1f} output tok/s, TTFT p50/p99 {lv.ttft.p50:.3f}/"
              f"{lv.ttft.p99:.3f} s, TPOT p50 {1000 * lv.tpot.p50:.1f} ms, "
              f"{lv.prompt_tokens} prompt tokens ({lv.cached_tokens} cached)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:52625/v1", help="ends in /v1")
    p.add_argument("--label", default="kiln", help="the server's name in results and charts")
    p.add_argument("--model", default="smollm2:135m", help="sent as the request's model")
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
    p.add_argument("--out", help="results JSON (default: bench/results/LABEL.json)")
    p.add_argument("--chart", help="PNG chart (default: the JSON path with .png)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no table")
    p.add_argument("--plot", nargs="+", metavar="JSON", help="merge result files into --chart")
    p.add_argument("--compare", nargs="+", metavar="JSON",
                   help="ratios of the first label over the second, from result files")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare:
        print(compare(load_levels(args.compare)))
    if args.plot:
        plot(load_levels(args.plot), Path(args.chart or "bench/results/serve.png"))
    if args.compare or args.plot:
        return 0
    try:
        cfg = BenchConfig(
            base_url=args.base_url.rstrip("/"), label=args.label, model=args.model,
            prompt_sets=[s.strip() for s in args.prompts.split(",") if s.strip()],
            concurrency=[int(c) for c in args.concurrency.split(",") if c.strip()],
            num_requests=args.requests, max_tokens=args.max_tokens, long_tokens=args.long_tokens,
            warmup=args.warmup, seed=args.seed, timeout=args.timeout)
    except ValueError as exc:
        print(f"serve.py: {exc}", file=sys.stderr)
        return 2
    levels = asyncio.run(run_bench(cfg, args.quiet))
    out = Path(args.out or f"bench/results/{cfg.label}.json")
    write_results(cfg, levels, out)
    plot(load_levels([str(out)]), Path(args.chart) if args.chart else out.with_suffix(".png"))
    if not args.quiet:
        print_levels(levels)
    failed = [r["error"] for lv in levels for r in lv.requests if r["error"]]
    if failed:
        print(f"serve.py: {len(failed)} request(s) failed, first: {failed[0]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
