"""kiln under bad input, load and shutdown, against a real `kiln serve` with a small KV pool
(2,048 tokens, 16 running requests at most, so that requests queue and get preempted):

- a request the whole pool cannot hold is a 400 before any prefill, not a hang;
- inputs that used to be 500s (a lone surrogate, model names no file system holds) are 4xx;
- a hypothesis fuzz over request bodies (every field, every JSON type, unicode edge cases)
  gets no 5xx and leaves the server healthy;
- a soak: 64 clients, a third hanging up mid-stream: every request completes or is cancelled,
  and in_flight and the pool's free blocks return to their idle values;
- a forced tool call under heavy penalties completes (no whitespace runs, no second call);
- SIGTERM: new requests get 503, a reply that outlasts --shutdown-timeout ends with
  finish_reason "abort" and [DONE], the process exits 0 without a traceback.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import signal
import threading
import time

import httpx
import pytest
from api_server import MODEL, KilnServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

KV_TOKENS = 2048


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln"), "--ctx-len", "4096", "--kv-cache-tokens",
                    str(KV_TOKENS), "--max-num-seqs", "16") as s:
        yield s


def assert_error_shape(r: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= r.status_code < 500 if status is None else r.status_code == status, \
        (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    return err


def wait_idle(server: KilnServer, timeout: float = 120.0) -> dict:
    """/health once no request is in flight and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        h = server.health()
        if h["in_flight"] == 0 and h["kv_free_blocks"] == h["kv_total_blocks"]:
            return h
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {h}"
        time.sleep(0.1)


def test_a_request_the_pool_cannot_hold_is_refused_before_prefill(server):
    mark = server.log_mark()
    prompt = " hello" * 2000  # about 2,000 tokens: inside the context, past pool - max_tokens
    r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 100})
    err = assert_error_shape(r, 400)
    assert err["code"] == "context_length_exceeded" and str(KV_TOKENS) in err["message"]
    assert "Prefill chunk" not in server.log_since(mark)
    # Without max_tokens it runs, and its reply ends where the pool is full.
    r = server.post("/v1/completions", {"prompt": prompt, "temperature": 1.5, "seed": 3},
                    timeout=300)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= KV_TOKENS
    wait_idle(server)
    ok = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 3})
    assert ok.status_code == 200


@pytest.mark.parametrize("body", [
    b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
    b'{"prompt": "\\udfff", "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "hi"}], "user": "\\ud83d"}',
], ids=["message", "prompt", "other-field"])
def test_a_lone_surrogate_is_a_400(server, body):
    path = "/v1/completions" if b"prompt" in body else "/v1/chat/completions"
    assert "surrogate" in assert_error_shape(server.post(path, body), 400)["message"]


@pytest.mark.parametrize("model", ["~nobody", "~nobody/model.gguf", "a" * 300,
                                   "x" * 300 + "/m.gguf", "nul\u0000.gguf", "/etc/shadow"])
def test_model_names_no_file_system_holds_are_4xx(server, model):
    r = server.post("/v1/chat/completions", {"model": model, "max_tokens": 2,
                                             "messages": [{"role": "user", "content": "hi"}]})
    assert_error_shape(r)


# --- the fuzz -------------------------------------------------------------------------------

leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(st.characters(exclude_categories=()), max_size=12))
json_value = st.recursive(leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                          max_leaves=10)
number = st.floats(-3, 3, allow_nan=False) | st.integers(-3, 100) | json_value
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]) | json_value,
     "content": st.text(st.characters(exclude_categories=()), max_size=20) | json_value},
    optional={"name": json_value, "tool_calls": json_value, "tool_call_id": json_value})
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FIELDS = {
    "model": st.sampled_from(["smollm2:135m", "", "~nobody", "q" * 300, "/etc/passwd",
                              "nope.gguf"]) | json_value,
    "messages": st.lists(message, max_size=3) | json_value,
    "prompt": st.text(st.characters(exclude_categories=()), max_size=30) | json_value,
    "temperature": number, "top_p": number, "top_k": number, "min_p": number,
    "seed": st.integers(-2**64, 2**64) | json_value, "presence_penalty": number,
    "frequency_penalty": number, "repetition_penalty": number, "repeat_last_n": number,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5) | json_value,
    "stream": st.booleans() | json_value,
    "stream_options": st.just({"include_usage": True}) | json_value,
    "logprobs": st.booleans() | st.integers(-1, 25) | json_value,
    "top_logprobs": st.integers(-1, 25) | json_value,
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}])
    | json_value,
    "tools": st.just([TOOL]) | json_value,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_value,
    "n": json_value, "logit_bias": json_value, "user": json_value, "echo": json_value,
    "continue_final_message": json_value, "think": json_value,
}
# max_tokens is always sent, small or of a wrong type (not null: that would mean "no limit").
MAX_TOKENS = st.integers(1, 4) | st.booleans() | st.text(max_size=3) | st.floats(-1, 1) \
    | st.lists(st.integers(), max_size=2)
# Half the bodies start valid and get up to four well-typed fields (in range or not: an
# out-of-range value is a warning and a 200); the rest are any JSON object with any fields.
PLAUSIBLE_BASE = st.sampled_from([
    {"messages": [{"role": "user", "content": "Say hi."}]}, {"prompt": "Hello"},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "2+2?"}]}])
real = st.floats(-3, 3, allow_nan=False)
PLAUSIBLE_FIELDS = {
    "temperature": real, "top_p": real, "top_k": st.integers(-2, 100), "min_p": real,
    "seed": st.integers(-2**63, 2**63 - 1), "presence_penalty": real,
    "frequency_penalty": real, "repetition_penalty": real,
    "repeat_last_n": st.integers(-1, 64), "stop": st.lists(st.text(max_size=3), max_size=4),
    "stream": st.booleans(), "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
    "response_format": FIELDS["response_format"], "user": st.text(max_size=10),
    "stream_options": st.just({"include_usage": True}),
}
some_fields = st.lists(st.sampled_from(sorted(PLAUSIBLE_FIELDS)), max_size=4,
                       unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({k: PLAUSIBLE_FIELDS[k] for k in keys}))
plausible = st.tuples(PLAUSIBLE_BASE, some_fields, st.integers(1, 4)).map(
    lambda t: {**t[0], **t[1], "max_tokens": t[2]})
body_strategy = plausible | st.fixed_dictionaries({"max_tokens": MAX_TOKENS}, optional=FIELDS)
STATUSES: collections.Counter = collections.Counter()


def send(server: KilnServer, path: str, raw: bytes) -> httpx.Response:
    """POST raw bytes; a streamed 200 is read to its end (it must end in [DONE])."""
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", server.url + path, content=raw,
                           headers={"Content-Type": "application/json"}) as r:
            text = r.read().decode(errors="replace")
    if r.status_code == 200 and r.headers.get("content-type", "").startswith(
            "text/event-stream"):
        assert text.rstrip().endswith("data: [DONE]"), text[-500:]
    return r


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(body=body_strategy | st.binary(max_size=40), chat=st.booleans())
def test_fuzzed_bodies_get_no_5xx(server, body, chat):
    if isinstance(body, dict) and ("messages" in body) != ("prompt" in body):
        chat = "messages" in body  # a plausible body goes to its own endpoint
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = send(server, "/v1/chat/completions" if chat else "/v1/completions", raw)
    STATUSES[r.status_code] += 1
    assert r.status_code < 500, (r.status_code, r.text[:500], raw[:500])
    if r.status_code >= 400:
        assert_error_shape(r)


def test_after_the_fuzz_the_server_is_healthy_and_idle(server):
    print(f"\nfuzz statuses: {dict(sorted(STATUSES.items()))}")
    assert sum(STATUSES.values()) >= 300
    wait_idle(server)


# --- the soak -------------------------------------------------------------------------------

def test_soak_64_clients_a_third_hanging_up(server):
    """Prompts of 40-400 tokens, 12-token replies, 64 at once on a pool of 2,048 tokens and 16
    seats: they queue and get preempted. Every client that stays gets its whole stream."""
    rng = random.Random(20)
    idle = server.health()
    words = ["kiln", "fire", "clay", "glaze", "pot", "heat", "ash", "wheel"]

    async def client(i: int) -> str:
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(40, 400)))
        hang_up_after = rng.randint(1, 6) if i % 3 == 0 else None
        body = {"prompt": prompt, "max_tokens": 12, "stream": True, "temperature": 0.7,
                "seed": i}
        async with httpx.AsyncClient(timeout=300) as http:
            async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return f"failed {r.status_code}"
                chunks = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return "completed"
                    chunks += 1
                    if hang_up_after is not None and chunks >= hang_up_after:
                        return "cancelled"  # leaving the block closes the connection
        return "failed: no [DONE]"

    async def run():
        return await asyncio.gather(*(client(i) for i in range(64)))

    outcomes = collections.Counter(asyncio.run(run()))
    print(f"\nsoak: {dict(outcomes)}; blocks free before {idle['kv_free_blocks']}"
          f"/{idle['kv_total_blocks']}")
    assert outcomes["completed"] + outcomes["cancelled"] == 64, outcomes
    after = wait_idle(server)
    print(f"soak: blocks free after {after['kv_free_blocks']}/{after['kv_total_blocks']}")


def test_a_forced_tool_call_under_heavy_penalties_completes(server):
    """Presence, frequency and repetition penalties of 2.0 once filled a forced call with
    whitespace (now one whitespace character per gap), then made the model open a second
    call: the newline of the call's fixed head was penalised, so the newline that closes
    the list lost to ',', and the second call never closed its string. Text the grammar
    dictates stays out of the penalty window, so the calls complete, as without penalties.
    The model's other defaults are sent too: the fuzz before leaves sticky values behind
    (repeat_last_n 0 among them, which would turn these penalties off)."""
    client = server.client()
    defaults = httpx.get(f"{server.url}/v1/models/{MODEL}").json()["defaults"]
    heavy = {**defaults, "temperature": 1.0, "presence_penalty": 2.0,
             "frequency_penalty": 2.0, "repetition_penalty": 2.0}
    for seed in range(4):
        r = client.chat.completions.create(
            model="smollm2:135m", seed=seed, max_tokens=60, extra_body=heavy,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[TOOL], tool_choice="required")
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert choice.message.tool_calls  # one, or (parallel calls allowed) a few, each whole
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            assert not re.search(r"\s\s", call.function.arguments), call.function.arguments
            assert isinstance(json.loads(call.function.arguments)["city"], str)


# --- shutdown -------------------------------------------------------------------------------

def test_sigterm_drains_then_ends_the_rest_with_abort(tmp_path):
    with KilnServer(tmp_path, "--shutdown-timeout", "2") as s:
        lines: list[str] = []
        short: dict = {}
        first_chunk = threading.Event()

        def long_stream():
            body = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "max_tokens": 3000,
                    "temperature": 0.0, "stream": True}  # greedy: it counts on and on
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        first_chunk.set()

        def short_request():
            short["r"] = httpx.post(s.url + "/v1/completions", timeout=60, json={
                "prompt": "Hello", "max_tokens": 5, "temperature": 0.0})

        t = threading.Thread(target=long_stream)
        t.start()
        assert first_chunk.wait(60)
        u = threading.Thread(target=short_request)
        u.start()
        time.sleep(0.2)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                             timeout=30)
        assert_error_shape(refused, 503)
        t.join(60)
        u.join(60)
        assert s.proc.wait(timeout=30) == 0
        log = s.log_text()
    assert lines[-1] == "data: [DONE]", lines[-3:]
    finishes = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in lines[:-1]]
    assert finishes[-1] == "abort" and finishes.count("abort") == 1, finishes[-3:]
    assert short["r"].status_code == 200
    assert short["r"].json()["choices"][0]["finish_reason"] == "length"
    assert "Traceback" not in log and "Event loop is closed" not in log, log[-3000:]
