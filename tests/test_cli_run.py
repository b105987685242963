"""`kiln run` end to end, as a user types it, for each catalogue family: the prompt it builds
is transformers' (one BOS where the template writes one), and a greedy reply is
transformers' greedy reply (tests/golden, from tests/make_golden.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.runtime.models.loader import load_model
from kiln.runtime.store.pull import ensure_model

GOLDEN = Path(__file__).parent / "golden"
MODELS = ["smollm2:135m", "gemma3:270m"]


def _first_user_only_case(path: Path) -> dict:
    cases = json.loads((GOLDEN / f"{path.stem}.json").read_text())
    return next(c for c in cases if [m["role"] for m in c["messages"]] == ["user"])


def _kiln_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.api.cli", "run", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("tag", MODELS)
def test_chat_prompt_is_transformers_prompt(tag):
    """The shared bootstrap renders and tokenizes a chat as apply_chat_template does: Gemma's
    template writes <bos> itself, so no second BOS is added (`[2, 2, 105, ...]` before)."""
    loaded = load_model(tag)
    case = _first_user_only_case(loaded.path)
    assert loaded.chat_prompt_ids(case["messages"]) == case["prompt_ids"]


def test_kiln_run_writes_the_greedy_reply_of_transformers():
    """Gemma 3's defaults add no penalty, so temperature 0 is plain greedy decoding; with
    --dtype float32 the products are fp32, whose logits are transformers' to ~1e-4."""
    path = ensure_model("gemma3:270m")
    case = _first_user_only_case(path)
    loaded = load_model("gemma3:270m")
    n = len(case["greedy_ids"])
    r = _kiln_run("gemma3:270m", case["messages"][0]["content"], "--temperature", "0",
                  "--max-tokens", str(n), "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    expected = loaded.tokenizer.decode(case["greedy_ids"], skip_special_tokens=True)
    assert r.stdout == expected + "\n"
    assert f"{len(case['prompt_ids'])} prompt tokens" in r.stderr
    assert f"{n} tokens at" in r.stderr


@pytest.mark.parametrize("drafting", [[], ["--speculative", "ngram"]], ids=["plain", "ngram"])
def test_kiln_run_default_model_answers_and_reports_speed(drafting):
    r = _kiln_run("Say 'one, two, three' three times.", "--max-tokens", "24", "--seed", "1",
                  *drafting)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "prompt tokens in" in r.stderr and "tok/s" in r.stderr
    assert ("drafted tokens kept" in r.stderr) == bool(drafting)


def test_kiln_run_names_a_missing_model_and_exits_1(tmp_path):
    r = _kiln_run(str(tmp_path / "nope.gguf"), "hi")
    assert r.returncode == 1
    assert "nope.gguf" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("flags,int8", [({}, True), ({"dtype": "float32"}, False),
                                        ({"int8_activations": False}, False)])
def test_the_cpu_products_take_8_bit_activations_unless_told_otherwise(flags, int8):
    from kiln.runtime.engine.bootstrap import EngineOptions, build_engine

    loaded, _ = build_engine("smollm2:135m", EngineOptions(ctx_len=512, **flags))
    assert loaded.model.backend.int8_products is int8
