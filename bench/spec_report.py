"""bench/spec.sh's table: per workload and level, each server's output tok/s (the median of the
runs) and, for a drafting server, the median of its runs' ratios to the same server without
drafting (the run before it, on the same prompts); for kiln, the drafted tokens kept (from
/metrics around each run) and the tokens a step yields. Merges each server's runs into
STEM-LABEL.json.

    python bench/spec_report.py WORK STEM MODEL THREADS K LABEL...
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

KINDS = ("editing", "quoting", "free")
RUN = re.compile(r"(?P<label>.+)-(?P<kind>editing|quoting|free)-(?P<rep>\d+)\.json")


def counter(path: Path, name: str) -> float:
    try:
        m = re.search(rf"^{re.escape(name)} (\S+)$", path.read_text(), re.M)
    except OSError:
        return 0.0
    return float(m.group(1)) if m else 0.0


def main() -> None:
    work, stem, model, threads, k, *labels = sys.argv[1:]
    work = Path(work)
    runs: dict[tuple[str, str, int], list[dict]] = {}
    for lb in labels:
        merged = None
        for path in sorted(work.glob(f"{lb}-*-*.json")):
            m = RUN.fullmatch(path.name)
            if m is None or m["label"] != lb:
                continue
            doc = json.loads(path.read_text())
            runs[lb, m["kind"], int(m["rep"])] = doc["levels"]
            if merged is None:
                merged = doc
            else:
                merged["levels"] += doc["levels"]
        Path(f"{stem}-{lb}.json").write_text(json.dumps(merged, indent=1))
    reps = sorted({rep for _, _, rep in runs})
    levels = sorted({lv["concurrency"] for lvs in runs.values() for lv in lvs})

    def tps(lb: str, kind: str, rep: int, c: int) -> float:
        return next(lv["output_throughput"] for lv in runs[lb, kind, rep]
                    if lv["concurrency"] == c)

    print(f"{model}, {threads} threads, k = {k}, greedy with penalties off. Output tok/s, the "
          f"median of {len(reps)} runs, each after the same server without drafting on the "
          "same prompts; (x): the median of those runs' ratios")
    head = ["workload", "c", *labels, "kiln kept / drafted", "tokens per step"]
    rows = []
    for kind in KINDS:
        for c in levels:
            cells = []
            for lb in labels:
                cell = f"{statistics.median(tps(lb, kind, r, c) for r in reps):.1f}"
                if lb.endswith("-ngram"):
                    base = lb.removesuffix("-ngram")
                    ratio = statistics.median(tps(lb, kind, r, c) / tps(base, kind, r, c)
                                              for r in reps)
                    cell += f" ({ratio:.2f}x)"
                cells.append(cell)
            rows.append([kind, str(c), *cells, "", ""])
        drafted = kept = out = 0.0
        for r in reps:
            pre, post = (work / f"kiln-ngram-{kind}-{r}.{s}" for s in ("before", "after"))
            drafted, kept, out = (total + counter(post, name) - counter(pre, name)
                                  for total, name in (
                                      (drafted, "kiln:spec_decode_num_draft_tokens_total"),
                                      (kept, "kiln:spec_decode_num_accepted_tokens_total"),
                                      (out, "kiln:generation_tokens_total")))
        rows[-1][-2:] = [f"{kept:.0f} / {drafted:.0f}",
                         f"{out / max(out - kept, 1):.2f}"]  # each step samples one token
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(x.ljust(w) for x, w in zip(r, widths)))


if __name__ == "__main__":
    main()
