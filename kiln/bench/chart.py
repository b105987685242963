"""The chart: one row per prompt set, output tokens/s, TTFT p50 and TPOT p50 against
concurrency, one line per server label. matplotlib comes with the `bench` extra; without it
there is no chart, and the run says so instead of failing."""

from __future__ import annotations

from pathlib import Path

from kiln.bench.prompts import PROMPT_SETS
from kiln.bench.record import LabelResults


class ChartUnavailable(Exception):
    pass


def plot(merged: dict[str, LabelResults], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ChartUnavailable("the chart needs matplotlib: pip install 'kiln[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in PROMPT_SETS if any(lv["prompt_set"] == k
                                           for r in merged.values() for lv in r.levels)]
    metrics = [("output tokens/s", lambda lv: lv["output_throughput"]),
               ("TTFT p50 (s)", lambda lv: lv["ttft"]["p50"]),
               ("TPOT p50 (ms)", lambda lv: 1000 * lv["tpot"]["p50"])]
    fig, axes = plt.subplots(len(kinds), 3, figsize=(13, 3.4 * len(kinds)), squeeze=False)
    for row, kind in zip(axes, kinds, strict=True):
        ticks = sorted({lv["concurrency"] for r in merged.values() for lv in r.levels
                        if lv["prompt_set"] == kind})
        for ax, (name, get) in zip(row, metrics, strict=True):
            for label, results in merged.items():
                pts = sorted((lv["concurrency"], get(lv)) for lv in results.levels
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
