"""A client that disconnects during a long prefill stops its request between chunks
(request-parameters.md, "Cancelling stops between chunks"; contract.md, "Prefill chunking"),
and the server is left idle and serving."""

import re
import socket
import time

import httpx
import pytest
from api_server import MODEL, KilnServer, settle_log

CHUNK = 512
CHUNK_LINE = r"\[kiln\]  Prefill chunk (\d+)/(\d+) with (\d+) tokens"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln-disconnect"), "--prefill-chunk-len",
                    str(CHUNK)) as s:
        yield s


def long_prompt(topic: str) -> str:
    """About 3000 tokens, starting with `topic` so that two prompts share no cached blocks
    beyond the system prompt."""
    sentences = [f"{topic} note {i}: the value of item {i} is {i * 37 % 1000}."
                 for i in range(135)]
    return " ".join(sentences) + " Summarise the notes."


def wait_idle(server, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = server.health()
        if health["in_flight"] == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.1)


def assert_stopped_early(server, mark: int, prefix: str) -> None:
    aborted = server.wait_for_log(
        rf"\[kiln\]  Aborted request ({prefix}-[0-9a-f]+) \(client gone\) after 0 tokens",
        mark, timeout=120)
    time.sleep(1.0)  # a chunk that was still running would be logged by now
    log = settle_log(server, mark)
    chunks = [tuple(map(int, m)) for m in re.findall(CHUNK_LINE, log)]
    assert chunks, log
    total = chunks[0][1]
    assert total >= 5  # ~3000 tokens in chunks of 512
    assert all(n == total for _, n, _ in chunks)
    assert [i for i, _, _ in chunks] == list(range(1, len(chunks) + 1))
    assert len(chunks) < total, log  # stopped before the last chunk
    assert log.count("Aborted request") == 1 and aborted.group(1) in log
    health = wait_idle(server)
    assert (health["status"], health["model"], health["in_flight"]) == ("ok", MODEL, 0)
    assert health["kv_free_blocks"] == health["kv_total_blocks"]  # nothing leaked


def assert_still_serving(server) -> None:
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.choices[0].message.content is not None


def test_streaming_client_gone_mid_prefill_stops_the_request(server):
    mark = server.log_mark()
    body = {"model": MODEL, "stream": True, "max_tokens": 5,
            "messages": [{"role": "user", "content": long_prompt("Streamed")}]}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            # Keep the line iterator alive: a discarded one is closed by the garbage
            # collector, which closes the stream, i.e. the client leaves early.
            lines = r.iter_lines()
            first = next(lines)  # the role chunk is sent before the prefill
            assert first.startswith("data: ") and '"role": "assistant"' in first
            server.wait_for_log(r"Prefill chunk 1/\d+ with \d+ tokens", mark, timeout=120)
        # leaving the block closes the connection mid-prefill
    assert_stopped_early(server, mark, "chatcmpl")
    assert_still_serving(server)


def test_non_streaming_client_gone_mid_prefill_stops_the_request(server):
    mark = server.log_mark()
    body = httpx.Request("POST", f"{server.url}/v1/completions",
                         json={"model": MODEL, "prompt": long_prompt("Plain"),
                               "max_tokens": 5}).read()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        server.wait_for_log(r"Prefill chunk 1/\d+ with \d+ tokens", mark, timeout=120)
    assert_stopped_early(server, mark, "cmpl")
    assert_still_serving(server)
