"""Responses and streams on /v1/chat/completions and /v1/completions: the SSE chunk sequence
(checked raw with httpx and through the SDK), system_fingerprint, streamed == non-streamed,
stop strings, finish reasons, usage, /v1/completions' echo, logprobs and token-id prompts,
and 16 concurrent streaming clients."""

import asyncio
import json
import re

import httpx
import pytest
from api_server import MODEL, KilnServer

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
GREEDY = {"temperature": 0, "presence_penalty": 0, "frequency_penalty": 0,
          "repetition_penalty": 1.0}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details",
              "completion_tokens_details", "kv_token_occupancy_rate_percentage",
              "prefill_duration_ttft", "decoding_duration", "prefill_speed_tps",
              "decoding_speed_tps"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln-streaming")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def sse_events(server, path: str, body: dict) -> list[str]:
    """The raw `data:` payloads of one stream, checking the SSE framing on the way."""
    with httpx.stream("POST", f"{server.url}{path}", json={"model": MODEL, **body},
                      timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), raw
    return [e[len("data: "):] for e in events]


def chat_text(client, stream: bool, **kw) -> tuple[str, str]:
    kw = dict(model=MODEL, messages=QUESTION, **kw)
    kw["extra_body"] = {"repetition_penalty": 1.0, **kw.get("extra_body", {})}
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for c in client.chat.completions.create(stream=True, **kw):
        if c.choices:
            text += c.choices[0].delta.content or ""
            finish = c.choices[0].finish_reason or finish
    return text, finish


def cmpl_text(client, stream: bool, **kw) -> tuple[str, str]:
    kw = dict(model=MODEL, prompt="The three primary colours are", **kw)
    kw["extra_body"] = {"repetition_penalty": 1.0, **kw.get("extra_body", {})}
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    for c in client.completions.create(stream=True, **kw):
        if c.choices:
            text += c.choices[0].text
            finish = c.choices[0].finish_reason or finish
    return text, finish


# --- the chunk sequence ---

def test_chat_stream_chunk_sequence(server):
    events = sse_events(server, CHAT, {"messages": QUESTION, "max_tokens": 4, "stream": True,
                                       "stream_options": {"include_usage": True}, **GREEDY})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = {c["id"] for c in chunks}
    fps = {c["system_fingerprint"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert len(fps) == 1 and re.fullmatch(r"fp_[0-9a-f]{10}", fps.pop())
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    first, *middle, final, usage = chunks
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert first["choices"][0]["finish_reason"] is None
    assert middle and all(set(c["choices"][0]["delta"]) == {"content"}
                          and c["choices"][0]["finish_reason"] is None for c in middle)
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    assert text.strip()


def test_completions_stream_chunk_sequence(server):
    events = sse_events(server, CMPL, {"prompt": "The sky is", "max_tokens": 3, "stream": True,
                                       "stream_options": {"include_usage": True}, **GREEDY})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *text_chunks, usage = chunks
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert len({c["system_fingerprint"] for c in chunks}) == 1


def test_stream_without_include_usage_has_no_usage_chunk(server):
    events = sse_events(server, CHAT, {"messages": QUESTION, "max_tokens": 2, "stream": True,
                                       **GREEDY})
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert all(c["choices"] and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_every_reply_carries_the_servings_fingerprint(server, client):
    """contract.md: what decides the bits (weights, kiln, backend and dtype), the same on
    every chunk of every stream and on whole responses, chat and completions alike."""
    fingerprints = set()
    for _ in range(2):
        for c in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1,
                                                stream=True):
            fingerprints.add(c.system_fingerprint)
    fingerprints.add(server.post(CHAT, {"model": MODEL, "messages": QUESTION,
                                        "max_tokens": 1}).json()["system_fingerprint"])
    fingerprints.add(server.post(CMPL, {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
                                 ).json()["system_fingerprint"])
    assert len(fingerprints) == 1
    assert re.fullmatch(r"fp_[0-9a-f]{10}", fingerprints.pop())


# --- same text streamed or not; stop strings; max_tokens ---

@pytest.mark.parametrize("text_of", [chat_text, cmpl_text], ids=["chat", "completions"])
def test_streamed_text_equals_non_streamed_text(client, text_of):
    plain = text_of(client, False, max_tokens=8, temperature=0)
    assert plain == text_of(client, True, max_tokens=8, temperature=0)
    assert plain[0].strip() and plain[1] in ("stop", "length")


@pytest.mark.parametrize("text_of", [chat_text, cmpl_text], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_strings_cut_the_text(client, text_of, stream):
    full, _ = text_of(client, False, max_tokens=8, temperature=0)
    words = full.split()
    assert len(words) >= 3, full
    word = words[2]
    cut = full[:full.index(word)]
    assert text_of(client, stream, max_tokens=8, temperature=0, stop=word) == (cut, "stop")
    assert text_of(client, stream, max_tokens=8, temperature=0,
                   stop=["never appears", word]) == (cut, "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_max_tokens_ends_with_length(client, stream):
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw))
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 3
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


# --- usage ---

def test_usage_fields(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4,
                                       temperature=0)
    u = r.usage.model_dump(exclude_none=True)
    assert USAGE_KEYS <= set(u)
    assert u["completion_tokens"] == 4
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 0 <= u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"]
    assert u["completion_tokens_details"]["reasoning_tokens"] == 0
    assert u["kv_token_occupancy_rate_percentage"] == pytest.approx(
        100 * u["total_tokens"] / 8192, abs=0.01)
    assert u["prefill_duration_ttft"] > 0 and u["decoding_duration"] > 0
    new_tokens = u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]
    assert u["prefill_speed_tps"] == pytest.approx(new_tokens / u["prefill_duration_ttft"],
                                                   rel=0.02)
    assert u["decoding_speed_tps"] == pytest.approx(3 / u["decoding_duration"], rel=0.02)


def test_repeated_long_prompt_reports_cached_tokens(client):
    text = " ".join(f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}."
                    for i in range(25)) + " Which facts are about even numbers?"
    msgs = [{"role": "user", "content": text}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage
    assert first.prompt_tokens == again.prompt_tokens > 200
    assert first.prompt_tokens_details.cached_tokens < 64  # at most the system prompt
    # Every full 16-token block is reused; the last prompt token is always recomputed.
    assert again.prompt_tokens_details.cached_tokens == (again.prompt_tokens - 1) // 16 * 16


# --- /v1/completions: echo, logprobs, token-id prompts ---

@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    from kiln.runtime.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_echo_returns_the_prompt_before_the_completion(client, stream):
    prompt = "The three primary colours are"
    plain, _ = cmpl_text(client, False, max_tokens=4, temperature=0)
    echoed, finish = cmpl_text(client, stream, max_tokens=4, temperature=0, echo=True)
    assert echoed == prompt + plain and finish == "length"


def test_integer_logprobs_shape(client):
    """The legacy shape; with echo the prompt's tokens come first, the very first with no
    logprob (nothing precedes it), as OpenAI's legacy API and vLLM answer."""
    prompt = "The three primary colours are"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                  logprobs=3, echo=True)
    choice = r.choices[0]
    lp = choice.logprobs
    n, p = r.usage.completion_tokens, r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) \
        == len(lp.text_offset) == p + n and n == 4
    assert "".join(lp.tokens[:p]) == prompt and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(p + n)]
    for logprob, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert len(top) == 3 and logprob <= 0
        values = list(top.values())
        assert values == sorted(values, reverse=True)
    for token, logprob, top in zip(lp.tokens[p:], lp.token_logprobs[p:], lp.top_logprobs[p:],
                                   strict=True):
        assert top[token] == pytest.approx(logprob)  # greedy: the top token was chosen
        assert logprob == pytest.approx(max(top.values()))


def test_token_id_prompts_equal_the_text_prompt(client, tokenizer):
    prompt = "The three primary colours are"
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    by_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                        temperature=0)
    for p in (ids, [ids], [prompt]):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
        assert r.choices[0].text == by_text.choices[0].text
        assert r.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)


# --- concurrency ---

TOPICS = ["cats", "the moon", "bread", "rain", "chess", "trains", "tea", "volcanoes",
          "bees", "winter", "rivers", "music", "owls", "glass", "maps", "salt"]


def test_sixteen_concurrent_streams_match_their_solo_outputs(server, client):
    def messages(topic):
        return [{"role": "user", "content": f"Write one sentence about {topic}."}]

    kw = dict(model=MODEL, max_tokens=4, temperature=0, presence_penalty=0,
              frequency_penalty=0, extra_body={"repetition_penalty": 1.0})
    solo = [client.chat.completions.create(messages=messages(t), **kw).choices[0]
            .message.content for t in TOPICS]
    assert len(set(solo)) > 8  # different prompts, different answers

    async def one(aclient, topic):
        text, finish = "", None
        stream = await aclient.chat.completions.create(messages=messages(topic), stream=True,
                                                       **kw)
        async for c in stream:
            text += c.choices[0].delta.content or ""
            finish = c.choices[0].finish_reason or finish
        return text, finish

    async def all_at_once():
        aclient = server.async_client()
        try:
            return await asyncio.gather(*(one(aclient, t) for t in TOPICS))
        finally:
            await aclient.close()

    results = asyncio.run(all_at_once())
    assert [text for text, _ in results] == solo
    assert all(finish in ("stop", "length") for _, finish in results)
    assert server.health()["in_flight"] == 0
