"""The tables a user reads: one run's summary, and the ratios of one server over another."""

from __future__ import annotations

from kiln.bench.record import LabelResults, find_level
from kiln.bench.runner import BenchRun


def format_table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [head, *rows])


def summary_table(run: BenchRun) -> str:
    head = ("prompts", "c", "requests", "failed", "req/s", "out tok/s", "out tok/req",
            "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "ITL p50 ms", "prompt tok", "cached")
    rows = []
    for lv in run.levels:
        done = lv.num_requests - lv.errors
        rows.append((lv.prompt_set, str(lv.concurrency), str(lv.num_requests), str(lv.errors),
                     f"{lv.request_throughput:.2f}", f"{lv.output_throughput:.1f}",
                     f"{lv.output_tokens / done:.1f}" if done else "-",
                     f"{lv.ttft.p50:.3f}", f"{lv.ttft.p99:.3f}", f"{1000 * lv.tpot.p50:.1f}",
                     f"{1000 * lv.itl.p50:.1f}", str(lv.prompt_tokens), str(lv.cached_tokens)))
    cfg = run.config
    title = (f"{cfg.label} ({cfg.model} at {cfg.base_url}), max_tokens {cfg.max_tokens}; "
             f"{run.ignore_eos.note}")
    return f"{title}\n{format_table(head, rows)}"


def compare_table(merged: dict[str, LabelResults]) -> str:
    """The ratio table of the first label over the second (kiln / llama-server)."""
    if len(merged) < 2:
        raise ValueError(f"--compare needs two server labels, found {list(merged)}")
    (a, ra), (b, rb) = list(merged.items())[:2]
    la, lb = ra.levels, rb.levels
    pair = lambda kind, c: (find_level(la, kind, c), find_level(lb, kind, c))
    rows = []

    def row(name, va, vb, fmt="{:.1f}"):
        if va is not None and vb is not None:
            rows.append((name, fmt.format(va), fmt.format(vb), f"{va / vb:.2f}" if vb else "-"))

    def prefill(lv, other):  # a server without usage has no prompt count: the prompts match
        ttft_sum = lv["ttft"]["mean"] * (lv["num_requests"] - lv["errors"])
        return (lv["prompt_tokens"] or other["prompt_tokens"]) / ttft_sum if ttft_sum else None

    def per_request(levels, kind):
        done = sum(lv["num_requests"] - lv["errors"] for lv in levels if lv["prompt_set"] == kind)
        out = sum(lv["output_tokens"] for lv in levels if lv["prompt_set"] == kind)
        return out / done if done else None

    cold, cached = pair("long", 1), pair("shared-prefix", 1)
    if all(cold):
        row("prefill tok/s (long, c=1)", prefill(cold[0], cold[1]), prefill(cold[1], cold[0]))
    for c in sorted({lv["concurrency"] for lv in la if lv["prompt_set"] == "short"}):
        if all(levels := pair("short", c)):
            row(f"output tok/s (short, c={c})", *(lv["output_throughput"] for lv in levels))
    row("output tokens / request (short)", per_request(la, "short"), per_request(lb, "short"))
    if all(cold) and all(cached):
        row("TTFT p50 cold (long, c=1) s", *(lv["ttft"]["p50"] for lv in cold), "{:.3f}")
        row("TTFT p50 cached (shared-prefix, c=1) s", *(lv["ttft"]["p50"] for lv in cached),
            "{:.3f}")
        row("TTFT cold / cached", *(x["ttft"]["p50"] / max(y["ttft"]["p50"], 1e-9)
                                    for x, y in zip(cold, cached, strict=True)), "{:.2f}")
        rows.append(("cached tokens (shared-prefix, c=1)",
                     *(str(lv["cached_tokens"]) for lv in cached), ""))
    table = format_table(("metric", a, b, f"{a} / {b}"), rows)
    unequal = [name for name, r in ((a, ra), (b, rb)) if not r.ignore_eos]
    if unequal:  # output tok/s then compares replies of different lengths
        table += (f"\nnote: {', '.join(unequal)} ran without ignore_eos: replies ended where "
                  "the model stopped, so output tokens per request may differ")
    return table
