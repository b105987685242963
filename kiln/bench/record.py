"""The results file: one run's settings, machine and levels as JSON; several files read back
and merged by server label for the tables and the chart."""

from __future__ import annotations

import datetime
import json
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

from kiln.bench.runner import BenchRun


def write_results(run: BenchRun, path: Path) -> None:
    cfg = run.config
    machine = {"platform": platform.platform(), "machine": platform.machine(),
               "processor": platform.processor(), "python": platform.python_version(),
               "cpu_count": os.cpu_count()}
    doc = {"label": cfg.label, "model": cfg.model, "base_url": cfg.base_url,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine, "config": asdict(cfg), "ignore_eos": asdict(run.ignore_eos),
           "levels": [asdict(lv) for lv in run.levels]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


@dataclass
class LabelResults:
    """Every level measured under one server label, from one or more files."""

    levels: list[dict]
    ignore_eos: bool | None  # every file's requests carried it (None: a file does not say)


def load_results(paths: list[str]) -> dict[str, LabelResults]:
    """{label: results}, merging files of the same label; labels in order of appearance."""
    merged: dict[str, LabelResults] = {}
    for p in paths:
        try:
            doc = json.loads(Path(p).read_text())
            label, levels = doc["label"], doc["levels"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{p} is not a kiln bench results file ({exc})") from exc
        sent = (doc.get("ignore_eos") or {}).get("sent")
        if label in merged:
            prev = merged[label]
            prev.levels.extend(levels)
            prev.ignore_eos = None if None in (prev.ignore_eos, sent) else \
                prev.ignore_eos and sent
        else:
            merged[label] = LabelResults(list(levels), sent)
    return merged


def find_level(levels: list[dict], kind: str, concurrency: int) -> dict | None:
    return next((lv for lv in levels if lv["prompt_set"] == kind
                 and lv["concurrency"] == concurrency), None)
