"""Every row of contract.md's Validation table over HTTP, on a server started with
`--ctx-len 512`: exact status and error body (`param` naming the field), out-of-range values
ignored with a warning, unknown fields ignored silently, the context checks before any
prefill, plain JSON errors for streaming requests; a file that is not a model is a 404."""

import re

import httpx
import openai
import pytest
from api_server import MODEL, KilnServer, settle_log

CTX = 512
HI = [{"role": "user", "content": "Hi"}]
MAX_LENGTH = {"error": {"message": "Max length reached!", "type": "model_error",
                        "param": None, "code": 400}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln-validation"), "--ctx-len", str(CTX)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": HI, "max_tokens": 1, **fields}


def assert_error(r: httpx.Response, status: int, param: str | None,
                 type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_
    assert err["param"] == param
    assert isinstance(err["message"], str) and err["message"]
    return err


def token_ids(n: int) -> list[int]:
    """A prompt of exactly n tokens for /v1/completions (ordinary vocabulary ids)."""
    return [1000 + (i * 7) % 3000 for i in range(n)]


# --- out-of-range values: 200, a warning naming field and value, the stored value kept ---

OUT_OF_RANGE = [
    ("temperature", 0.0, -1), ("top_p", 0.5, 0), ("top_p", 0.5, 1.5), ("top_k", 7, 0),
    ("min_p", 0.05, -0.1), ("min_p", 0.05, 1.5), ("presence_penalty", 0.25, -0.5),
    ("presence_penalty", 0.25, 2.5), ("frequency_penalty", 0.25, -1),
    ("frequency_penalty", 0.25, 3), ("repetition_penalty", 1.05, 0),
    ("repetition_penalty", 1.05, -1),
]


@pytest.mark.parametrize("field,stored,bad", OUT_OF_RANGE)
def test_out_of_range_value_is_ignored_with_a_warning(server, field, stored, bad):
    assert server.post("/v1/chat/completions", chat_body(**{field: stored})).status_code == 200
    mark = server.log_mark()
    r = server.post("/v1/chat/completions", chat_body(**{field: bad}))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None
    log = settle_log(server, mark)
    warnings = [line for line in log.splitlines() if "Ignoring" in line]
    assert len(warnings) == 1, log
    assert f"{field}={bad!r}" in warnings[0]
    assert f"keeping {float(stored)!r}" in warnings[0] or f"keeping {stored!r}" in warnings[0]


def test_ignored_values_do_not_change_what_is_generated(server, client):
    def say(**kw):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}],
            max_tokens=3, **kw).choices[0].message.content

    greedy = say(temperature=0)
    assert say(temperature=-1) == greedy  # the stored 0 is kept
    assert say() == greedy
    say(temperature=1.5, top_p=1.0, extra_body={"top_k": 1, "min_p": 0.0})
    assert say(extra_body={"top_k": 0}) == greedy  # top_k=1 kept: still greedy at 1.5


def test_repetition_penalty_below_one_is_accepted_with_a_loop_warning(server):
    mark = server.log_mark()
    r = server.post("/v1/chat/completions", chat_body(repetition_penalty=0.9))
    assert r.status_code == 200
    log = settle_log(server, mark)
    assert re.search(r"repetition_penalty=0\.9 is below 1.*loop", log), log
    assert "Ignoring" not in log
    # ...and it was stored: an invalid value now keeps 0.9.
    mark = server.log_mark()
    server.post("/v1/chat/completions", chat_body(repetition_penalty=0))
    assert "keeping 0.9" in settle_log(server, mark)
    server.post("/v1/chat/completions", chat_body(repetition_penalty=1.1))


# --- wrong JSON types, seed, repeat_last_n: 400 naming the field ---

@pytest.mark.parametrize("path,field,value", [
    ("/v1/chat/completions", "temperature", "hot"),
    ("/v1/chat/completions", "max_tokens", 1.5),
    ("/v1/chat/completions", "top_p", True),
    ("/v1/chat/completions", "top_k", 2.5),
    ("/v1/chat/completions", "presence_penalty", [1]),
    ("/v1/chat/completions", "stream", "yes"),
    ("/v1/chat/completions", "logprobs", 1),
    ("/v1/chat/completions", "stop", 5),
    ("/v1/completions", "max_tokens", "8"),
    ("/v1/completions", "frequency_penalty", {"v": 1}),
    ("/v1/completions", "echo", "true"),
])
def test_known_field_of_the_wrong_type_is_a_400(server, path, field, value):
    body = chat_body() if path == "/v1/chat/completions" else \
        {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    err = assert_error(server.post(path, {**body, field: value}), 400, field)
    assert err["code"] == "invalid_type"


@pytest.mark.parametrize("seed", [True, 1.5, "42", 2**63, -(2**63) - 1])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_seed_that_is_not_a_64_bit_integer_is_a_400(server, path, seed):
    body = chat_body(seed=seed) if path == "/v1/chat/completions" else \
        {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "seed": seed}
    assert_error(server.post(path, body), 400, "seed")


@pytest.mark.parametrize("value", ["5", 1.5, -2, False])
def test_bad_repeat_last_n_is_a_400(server, value):
    assert_error(server.post("/v1/chat/completions", chat_body(repeat_last_n=value)), 400,
                 "repeat_last_n")


def test_integral_seed_and_repeat_last_n_extremes_are_accepted(server):
    for fields in ({"seed": 2**63 - 1, "repeat_last_n": -1}, {"seed": -(2**63),
                                                               "repeat_last_n": 0}):
        assert server.post("/v1/chat/completions", chat_body(**fields)).status_code == 200


def test_unknown_fields_are_ignored_without_a_log_line(server, client):
    mark = server.log_mark()
    r = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=1,
        extra_body={"temprature": "hot", "frobnicate": {"x": [1, 2]}, "top_kk": -5})
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                  extra_body={"temprature": -3, "mystery": None})
    assert r.choices[0].finish_reason in ("stop", "length")
    lines = settle_log(server, mark).splitlines()
    assert lines and all(line.startswith("[kiln]  Prefill chunk") for line in lines), lines


# --- required fields ---

@pytest.mark.parametrize("body,param", [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"content": "Hi"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}, {"content": "x"}]},
     "messages[1].role"),
])
def test_missing_or_empty_messages_and_roleless_messages_are_a_400(server, body, param):
    assert_error(server.post("/v1/chat/completions", body), 400, param)


@pytest.mark.parametrize("body", [{"model": MODEL}, {"model": MODEL, "prompt": None}])
def test_missing_prompt_is_a_400(server, body):
    assert_error(server.post("/v1/completions", body), 400, "prompt")


def test_token_id_outside_the_vocabulary_is_a_400(server):
    assert_error(server.post("/v1/completions", {"prompt": [1, 2, 10**6], "max_tokens": 1}),
                 400, "prompt")


def test_unknown_model_is_a_404(server):
    err = assert_error(server.post("/v1/chat/completions", chat_body(model="nope:1b")), 404,
                       "model")
    assert err["code"] == "model_not_found"


# --- the context: "Max length reached!" before any prefill ---

def test_prompt_as_long_as_the_context_is_rejected_before_prefill(server):
    mark = server.log_mark()
    for n in (CTX, CTX + 300):
        r = server.post("/v1/completions", {"model": MODEL, "prompt": token_ids(n)})
        assert r.status_code == 400
        assert r.json() == MAX_LENGTH
    r = server.post("/v1/chat/completions",
                    {"model": MODEL, "messages": [{"role": "user", "content": "tea " * 600}]})
    assert r.status_code == 400 and r.json() == MAX_LENGTH
    assert "Prefill chunk" not in settle_log(server, mark)


def test_prompt_plus_max_tokens_over_the_context_is_rejected_before_prefill(server):
    mark = server.log_mark()
    r = server.post("/v1/completions", {"model": MODEL, "prompt": token_ids(CTX - 3),
                                        "max_tokens": 4})
    assert r.status_code == 400 and r.json() == MAX_LENGTH
    r = server.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "tea " * 200}],
        "max_tokens": CTX})
    assert r.status_code == 400 and r.json() == MAX_LENGTH
    assert "Prefill chunk" not in settle_log(server, mark)


def test_prompts_that_fit_generate_until_the_context_is_full(server, client):
    # One token of room left, max_tokens not sent: one token, finish_reason "length".
    r = client.completions.create(model=MODEL, prompt=token_ids(CTX - 1), temperature=0)
    assert r.usage.prompt_tokens == CTX - 1
    assert r.usage.completion_tokens == 1
    assert r.choices[0].finish_reason == "length"
    # prompt + max_tokens == context exactly is allowed (the prompt is now mostly cached).
    r = client.completions.create(model=MODEL, prompt=token_ids(CTX - 3), max_tokens=3,
                                  temperature=0)
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= CTX
    assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_context_error_through_the_sdk(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=token_ids(CTX))
    assert e.value.status_code == 400
    assert e.value.body == MAX_LENGTH["error"]


# --- streaming requests get a plain JSON 400, not an SSE stream ---

@pytest.mark.parametrize("path,body,param,type_", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "tea " * 600}]},
     None, "model_error"),
    ("/v1/completions", {"prompt": token_ids(CTX - 3), "max_tokens": 4}, None, "model_error"),
    ("/v1/chat/completions", {"messages": HI, "temperature": "hot"}, "temperature",
     "invalid_request_error"),
    ("/v1/completions", {"prompt": "Hi", "seed": "42"}, "seed", "invalid_request_error"),
    ("/v1/chat/completions", {"messages": HI, "continue_final_message": True},
     "continue_final_message", "invalid_request_error"),
])
def test_streaming_request_gets_a_plain_json_error(server, path, body, param, type_):
    with httpx.stream("POST", f"{server.url}{path}", timeout=60,
                      json={"model": MODEL, "stream": True,
                            "stream_options": {"include_usage": True}, **body}) as r:
        raw = r.read().decode()
    assert not raw.startswith("data:") and "[DONE]" not in raw
    err = assert_error(r, 400, param, type_)
    if type_ == "model_error":
        assert err == MAX_LENGTH["error"]


def test_streaming_error_through_the_sdk(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, stream=True,
                                       extra_body={"repeat_last_n": -5})
    assert e.value.body["param"] == "repeat_last_n"


# --- continue_final_message ---

@pytest.mark.parametrize("body", [
    {"messages": HI, "continue_final_message": True},
    {"messages": [{"role": "assistant", "content": "Hello"}, *HI],
     "continue_final_message": True},
    {"messages": [], "continue_final_message": True},
    {"continue_final_message": True},
    {"messages": [*HI, {"role": "assistant", "content": "The answer"}],
     "continue_final_message": True, "add_generation_prompt": True},
    {"messages": [*HI, {"role": "assistant", "content": "The answer"}],
     "continue_final_message": "yes"},
    {"messages": [*HI, {"role": "assistant", "content": "The answer"}],
     "continue_final_message": 1},
])
def test_bad_continue_final_message_is_a_400(server, body):
    assert_error(server.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                                      **body}), 400, "continue_final_message")


def test_continue_final_message_null_or_false_keeps_the_default(server):
    msgs = [*HI, {"role": "assistant", "content": "Hello"}]
    for value in (None, False):
        r = server.post("/v1/chat/completions", {"model": MODEL, "messages": msgs,
                                                 "max_tokens": 1, "temperature": 0,
                                                 "continue_final_message": value})
        assert r.status_code == 200, r.text


# --- a file that is not a model: 404, and the server keeps serving -------------------------
# (A request may not name a path at all: any path is this 404, a non-GGUF file in the models
# directory too; test_api_access covers both. The 500 an unexpected exception gets, quoting
# a request id, is test_protocol's.)

def test_a_file_that_is_not_a_gguf_is_a_404_and_the_server_keeps_serving(server, client,
                                                                          tmp_path):
    not_a_model = tmp_path / "broken.gguf"
    not_a_model.write_bytes(b"this is not a GGUF file")
    for path, body in (("/v1/chat/completions", chat_body(model=str(not_a_model))),
                       ("/api/load", {"model": str(not_a_model)})):
        err = assert_error(server.post(path, body), 404, "model")
        assert err["code"] == "model_not_found"
        # Still serving the model it had.
        health = server.health()
        assert (health["status"], health["model"], health["in_flight"]) == ("ok", MODEL, 0)
        r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        assert r.choices[0].message.content is not None


def test_models_shows_the_served_context_length(client):
    card = next(m for m in client.models.list().data if m.id == MODEL).model_dump()
    assert card["context_length"] == CTX
