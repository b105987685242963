"""`kiln bench` end to end against a real `kiln serve` at tiny sizes: the results JSON has the
structure the charts and the compare table read, with sane values, every reply runs to
max_tokens (kiln takes ignore_eos), and the PNGs exist. No timing assertions: the machine is
shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from api_server import KilnServer

pytestmark = pytest.mark.slow
KILN = Path(sys.executable).with_name("kiln")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def kiln_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(KILN), "bench", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One tiny benchmark run: short and ~200-token prompts at concurrency 1 and 2, 2 requests
    each, no warm-up."""
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "kiln.json"
    with KilnServer(tmp, "--kv-cache-tokens", "4096") as server:
        proc = kiln_bench("--base-url", f"{server.url}/v1", "--label", "kiln",
                        "--prompts", "short,long", "--concurrency", "1,2",
                        "--requests", "2", "--max-tokens", "4", "--long-tokens", "200",
                        "--warmup", "0", "--out", str(out), "--quiet", timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out, json.loads(out.read_text())


def test_results_record_server_and_machine(bench_run):
    _, doc = bench_run
    assert doc["label"] == "kiln" and doc["model"] == "smollm2:135m"
    assert doc["date"][:2] == "20"
    assert doc["machine"]["cpu_count"] == os.cpu_count()
    assert doc["config"]["concurrency"] == [1, 2] and doc["config"]["max_tokens"] == 4
    assert doc["ignore_eos"]["sent"] is True


def test_every_level_has_sane_throughput_and_latencies(bench_run):
    _, doc = bench_run
    assert [(lv["prompt_set"], lv["concurrency"]) for lv in doc["levels"]] == [
        (kind, c) for kind in ("short", "long") for c in (1, 2)]
    for lv in doc["levels"]:
        where = f"{lv['prompt_set']} c={lv['concurrency']}"
        assert lv["num_requests"] == 2 and lv["errors"] == 0, where
        assert lv["output_throughput"] > 0 and lv["request_throughput"] > 0, where
        assert lv["output_tokens"] == sum(r["output_tokens"] for r in lv["requests"]), where
        assert lv["prompt_tokens"] == sum(r["prompt_tokens"] for r in lv["requests"]), where
        for r in lv["requests"]:
            # ignore_eos: no reply ends before max_tokens, whatever the model would say
            assert r["output_tokens"] == 4 and r["finish_reason"] == "length", where
            assert 0 < r["ttft"] <= r["e2e"], where
            assert r["tpot"] is None or r["tpot"] > 0, where
        for metric in ("ttft", "e2e"):
            s = lv[metric]
            assert 0 < s["p50"] <= s["p99"], (where, metric, s)
        assert lv["prefill_tps"] > 0, where


def test_prompt_sets_have_the_intended_sizes_and_cached_tokens(bench_run):
    _, doc = bench_run
    by_set = {}
    for lv in doc["levels"]:
        by_set.setdefault(lv["prompt_set"], []).extend(lv["requests"])
    assert all(r["prompt_tokens"] < 100 for r in by_set["short"])
    assert all(200 <= r["prompt_tokens"] < 400 for r in by_set["long"])
    assert len({r["prompt_tokens"] for r in by_set["short"]}) > 1  # different questions
    # Every chat prompt starts with the template's system prompt: after the ignore_eos probe
    # (the first request, unmeasured) its full blocks come from the prefix cache. Long prompts
    # share nothing after it.
    assert all(0 < r["cached_tokens"] < 64 for lv in by_set.values() for r in lv)
    assert all(r["cached_tokens"] < 64 for r in by_set["long"])


def test_charts_and_compare_table(bench_run, tmp_path):
    out, doc = bench_run
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(doc, label="other")))
    merged = tmp_path / "merged.png"
    proc = kiln_bench("--plot", str(out), str(other), "--chart", str(merged))
    assert proc.returncode == 0, proc.stderr
    assert merged.read_bytes()[:8] == PNG_MAGIC
    proc = kiln_bench("--compare", str(out), str(other))
    assert proc.returncode == 0, proc.stderr
    table = {line.split("  ")[0]: line.split() for line in proc.stdout.splitlines()}
    for name in ("prefill tok/s (long, c=1)", "output tok/s (short, c=1)",
                 "output tok/s (short, c=2)", "output tokens / request (short)"):
        assert table[name][-1] == "1.00", proc.stdout  # a file against itself
    assert table["output tokens / request (short)"][-3:-1] == ["4.0", "4.0"]
    assert "without ignore_eos" not in proc.stdout

    # A peer that refused ignore_eos: the table says its replies may be of another length.
    refused = dict(doc, label="peer", ignore_eos={"sent": False, "note": "refused"})
    other.write_text(json.dumps(refused))
    proc = kiln_bench("--compare", str(out), str(other))
    assert proc.returncode == 0, proc.stderr
    assert "note: peer ran without ignore_eos" in proc.stdout
