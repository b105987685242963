"""The heavy requests of issue 33 (a 5 MB prompt, a 60 MB body, a 49k-entry logit_bias, a
200-deep schema, ...) and `Watch`, which times how long other clients wait meanwhile: a poller
asking GET /health every 50 ms and a client streaming a long completion. Used by
test_api_no_stall.py and bench/stall.py."""

from __future__ import annotations

import gc
import json
import threading
import time
from typing import NamedTuple

import httpx
from api_server import MODEL

MB = 1 << 20


class Heavy(NamedTuple):
    label: str
    path: str
    body: bytes
    status: int  # what it gets
    cpu_bound: bool = False  # real work that shares the cores with decoding


def heavy_requests() -> list[Heavy]:
    words = ("lorem ipsum dolor sit amet " * (5 * MB // 27 + 1))[:5 * MB]
    chat = [{"role": "user", "content": words}]
    schema: dict = {"type": "string"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    many = {"prompt": [f"Document {i}: " + "token " * 4000 for i in range(64)],
            "max_tokens": 8192, "logit_bias": {str(i): -1 for i in range(49152)},
            "stop": [f"stop{i}" for i in range(10_000)]}
    deep = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "deep", "schema": schema}}}
    cases = [
        ("completions, 5 MB prompt", "/v1/completions", {"prompt": words, "max_tokens": 4}, 400),
        ("chat, 5 MB message", "/v1/chat/completions", {"messages": chat}, 400),
        ("responses, 5 MB input", "/v1/responses", {"input": words}, 400),
        ("60 MB body", "/v1/completions", {"prompt": "x" * (60 * MB)}, 413),
        ("64 x 4k prompts, 49k logit_bias, 10k stops", "/v1/completions", many, 400),
        ("ollama chat, 5 MB message", "/api/chat", {"messages": chat, "stream": False}, 400),
        ("ollama generate, 5 MB prompt", "/api/generate", {"prompt": words, "stream": False},
         400),
        ("ollama, 60 MB body", "/api/generate", {"prompt": "x" * (60 * MB)}, 413),
        ("chat, 200-deep schema", "/v1/chat/completions", deep, 200, True),
        ("tokenize, 5 MB prompt", "/tokenize", {"prompt": words}, 200, True),
    ]
    return [Heavy(label, path, json.dumps({"model": MODEL, **body}).encode(), status, *cpu)
            for label, path, body, status, *cpu in cases]


class Watch:
    """/health every 50 ms and one long stream, each timing its worst wait."""

    def __init__(self, url: str):
        self.url, self.stop = url, threading.Event()
        self.worst_health = self.worst_gap = 0.0
        self.chunks = 0
        self.threads = [threading.Thread(target=self._poll), threading.Thread(target=self._stream)]

    def __enter__(self) -> Watch:
        # The poller times the server, not this process: a full collection here (the whole
        # suite's ~400k objects: 0.2 s on an idle core, more on one the server shares) would
        # stop the poller mid-wait and be counted as the server's stall.
        gc.freeze()
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 30
        while self.chunks < 5 and time.monotonic() < deadline:  # the stream is under way
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        gc.unfreeze()

    def _poll(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                client.get(f"{self.url}/health").raise_for_status()
                self.worst_health = max(self.worst_health, time.perf_counter() - t0)
                time.sleep(0.05)

    def _stream(self) -> None:
        body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 4000,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                    last = None
                    for _ in r.iter_lines():
                        now = time.perf_counter()
                        if last is not None and self.chunks >= 5:
                            self.worst_gap = max(self.worst_gap, now - last)
                        last = now
                        self.chunks += 1
                        if self.stop.is_set():
                            break


def post(url: str, heavy: Heavy) -> httpx.Response:
    return httpx.post(url + heavy.path, content=heavy.body, timeout=600,
                      headers={"Content-Type": "application/json"})
