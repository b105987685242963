"""What the chat page's tests compare the page with: the server's own numbers, read over plain
HTTP beside the browser."""

from __future__ import annotations

import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric_sums(text: str) -> dict[str, float]:
    sums = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    return sums


def aborted_requests(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kiln:request_success_total"
               and s.labels.get("finished_reason") == "abort")


def api_first_token_ms(server, body: dict) -> float:
    """The API's own time to first text for `body`, from an HTTP client beside the page (read
    to the end: a client that hung up would count as an aborted request)."""
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=60) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    first = (time.perf_counter() - t0) * 1000
    assert first is not None, "the API's stream had no text"
    return first
