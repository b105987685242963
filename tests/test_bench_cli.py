"""`kiln bench`'s decisions that need no server of kiln's own: what it does when a server
refuses `ignore_eos` (as OpenAI's API refuses any field it does not know), when a request is
refused for another reason, when the settings are bad, and when matplotlib is missing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from kiln.bench.client import BenchError, probe_ignore_eos
from kiln.bench.config import BenchConfig

# OpenAI's answer to a field it does not know (api.openai.com, chat completions).
UNRECOGNIZED = {"error": {"message": "Unrecognized request argument supplied: ignore_eos",
                          "type": "invalid_request_error", "param": None, "code": None}}
REPLY = {"id": "x", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "length"}]}


def probe(handler) -> tuple:
    seen = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return handler(seen[-1])

    async def go():
        async with httpx.AsyncClient(base_url="http://peer/v1",
                                     transport=httpx.MockTransport(record)) as client:
            return await probe_ignore_eos(client, "m")

    return asyncio.run(go()), seen


def test_a_server_that_refuses_ignore_eos_is_benchmarked_without_it():
    result, seen = probe(lambda body: httpx.Response(400, json=UNRECOGNIZED)
                         if "ignore_eos" in body else httpx.Response(200, json=REPLY))
    assert result.sent is False
    assert "Unrecognized request argument supplied: ignore_eos" in result.note
    assert [("ignore_eos" in b, b["max_tokens"]) for b in seen] == [(True, 1), (False, 1)]


def test_a_server_that_takes_ignore_eos_is_asked_once():
    result, seen = probe(lambda body: httpx.Response(200, json=REPLY))
    assert result.sent is True and len(seen) == 1 and seen[0]["ignore_eos"] is True


def test_a_request_refused_for_another_reason_stops_the_run_with_the_servers_words():
    missing = {"error": {"message": "The model `m` does not exist.", "code": "model_not_found"}}
    with pytest.raises(BenchError, match="HTTP 404: The model `m` does not exist"):
        probe(lambda body: httpx.Response(404, json=missing))


@pytest.mark.parametrize("field, value, words", [
    ("prompt_sets", ("short", "poems"), "unknown prompt set"),
    ("concurrency", (1, 0), "positive"),
    ("max_tokens", 0, "at least 1"),
    ("base_url", "127.0.0.1:8000/v1", "not an http"),
])
def test_bad_settings_are_refused_where_they_are_built(field, value, words):
    good = dict(base_url="http://127.0.0.1:8000/v1", label="a", model="m",
                prompt_sets=("short",), concurrency=(1,), num_requests=0, max_tokens=8,
                long_tokens=10, warmup=0, seed=0, timeout=10.0)
    BenchConfig(**good)
    with pytest.raises(ValueError, match=words):
        BenchConfig(**{**good, field: value})


def test_an_unreachable_server_is_one_clear_line_and_exit_1(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kiln.api.cli", "bench", "--base-url",
                           "http://127.0.0.1:9/v1", "--model", "m", "--out",
                           str(tmp_path / "r.json")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith("kiln bench: cannot reach http://127.0.0.1:9/v1"), proc.stderr
    assert not (tmp_path / "r.json").exists()


def test_without_matplotlib_the_chart_is_refused_with_the_extra_to_install(tmp_path):
    doc = {"label": "a", "levels": []}
    (tmp_path / "a.json").write_text(json.dumps(doc))
    # matplotlib hidden from this interpreter, as in an install without the `bench` extra
    code = ("import sys; sys.modules['matplotlib'] = None; from kiln.api.cli import main; "
            f"sys.exit(main(['bench', '--plot', {str(tmp_path / 'a.json')!r}, '--chart', "
            f"{str(tmp_path / 'a.png')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert "the chart needs matplotlib: pip install 'kiln[bench]'" in proc.stderr
    assert not (tmp_path / "a.png").exists()
