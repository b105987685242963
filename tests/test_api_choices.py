"""What clients send beyond one choice of one prompt, through the OpenAI SDK against a real
server: n, logit_bias, min_tokens, ignore_eos, the developer role, several completion
prompts, and echo with logprobs (lm-eval's loglikelihood request)."""

import openai
import pytest
from api_server import FP32, MODEL, KilnServer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = dict(temperature=0, extra_body={"repetition_penalty": 1.0})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln"), "--per-request-sampling",
                    *FP32) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, **kw)


def test_n_choices_are_distinct_repeatable_and_counted_once(client):
    kw = dict(messages=[{"role": "user", "content": "Invent a name for a dragon."}],
              n=3, max_tokens=8, seed=7, temperature=1.0)
    a, b = chat(client, **kw), chat(client, **kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1
    one = chat(client, **{**kw, "n": 1})  # choice 0 is the request without n
    assert one.choices[0].message.content == texts[0]
    assert a.usage.prompt_tokens == one.usage.prompt_tokens
    assert a.usage.completion_tokens == sum(
        chat(client, **{**kw, "n": 1, "seed": 7 + i}).usage.completion_tokens for i in range(3))


def test_streamed_choices_equal_the_whole_ones(client):
    kw = dict(messages=QUESTION, n=2, max_tokens=6, seed=3, temperature=0.8)
    whole = chat(client, **kw)
    text, finish = {0: "", 1: ""}, {}
    usage = None
    for chunk in chat(client, stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish.get(c.index)
        usage = chunk.usage or usage
    assert text == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_developer_role_reads_as_system(client):
    def reply(role):
        return chat(client, messages=[{"role": role, "content": "Answer in French."},
                                      *QUESTION], max_tokens=8, **GREEDY)
    dev, system = reply("developer"), reply("system")
    assert dev.choices[0].message.content == system.choices[0].message.content
    assert dev.usage.prompt_tokens == system.usage.prompt_tokens


def test_logit_bias_forces_and_bans_tokens(client, smollm2):
    paris = smollm2.tokenizer.encode("Paris", add_special_tokens=False)
    assert len(paris) == 1
    forced = chat(client, messages=QUESTION, max_tokens=3, logit_bias={str(paris[0]): 100},
                  **GREEDY)
    assert forced.choices[0].message.content == "Paris" * 3
    plain = chat(client, messages=QUESTION, max_tokens=1, logprobs=True, **GREEDY)
    first = plain.choices[0].logprobs.content[0]
    first_id = smollm2.tokenizer.encode(first.token, add_special_tokens=False)[0]
    banned = chat(client, messages=QUESTION, max_tokens=1, logprobs=True, top_logprobs=2,
                  logit_bias={str(first_id): -100}, **GREEDY)
    got = banned.choices[0].logprobs.content[0]
    assert got.token != first.token and got.token == got.top_logprobs[1].token


def test_min_tokens_and_ignore_eos(client):
    plain = chat(client, messages=QUESTION, max_tokens=40, **GREEDY)
    n = plain.usage.completion_tokens
    assert plain.choices[0].finish_reason == "stop" and n < 30
    longer = chat(client, messages=QUESTION, max_tokens=40,
                  **{**GREEDY, "extra_body": {**GREEDY["extra_body"], "min_tokens": n + 6}})
    assert longer.usage.completion_tokens >= n + 6
    assert longer.choices[0].message.content.startswith(plain.choices[0].message.content)
    ignoring = chat(client, messages=QUESTION, max_tokens=n + 4,
                    **{**GREEDY, "extra_body": {**GREEDY["extra_body"], "ignore_eos": True}})
    assert ignoring.usage.completion_tokens == n + 4
    assert ignoring.choices[0].finish_reason == "length"


def test_several_prompts_answer_as_several_choices(client):
    prompts = ["The sky is", "One, two, three,", [504, 3575, 282]]
    many = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4,
                                     temperature=0)
    assert [c.index for c in many.choices] == list(range(6))
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
               for p in prompts]
    assert [c.text for c in many.choices] == [s.choices[0].text for s in singles
                                              for _ in range(2)]
    assert many.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert many.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)


def test_echo_logprobs_score_every_prompt_token(client):
    """lm-eval's loglikelihood request: each prompt token's logprob given the ones before
    it, checked against the same token forced (logit_bias) as the next token of the prompt
    cut before it; logprobs are raw, so the bias does not change them. The same bits: a
    row's logits do not depend on its batch on the CPU, and both logprobs are the sampler's
    computation."""
    ids = [504, 3575, 282, 4649, 314, 7042, 30]
    out = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1,
                                    max_tokens=1, temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert out.choices[0].text.startswith("".join(lp.tokens[:len(ids)]))
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    for k in (1, 4, 6):
        forced = client.completions.create(model=MODEL, prompt=ids[:k], max_tokens=1,
                                           logprobs=0, temperature=0,
                                           logit_bias={str(ids[k]): 100})
        assert forced.choices[0].logprobs.tokens[0] == lp.tokens[k]
        assert forced.choices[0].logprobs.token_logprobs[0] == lp.token_logprobs[k]
    streamed = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1,
                                         max_tokens=1, temperature=0, stream=True)
    tokens, values = [], []
    for chunk in streamed:
        for c in chunk.choices:
            if c.logprobs:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert tokens == lp.tokens and values == lp.token_logprobs


@pytest.mark.parametrize("body,param", [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": "2"}, "n"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias.5"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"), ({"min_tokens": -1}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [99999999], "min_tokens": 2}, "stop_token_ids"),
])
def test_bad_values_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, messages=QUESTION, max_tokens=1, extra_body=body)
    assert exc.value.body["param"] == param


def test_too_many_prompts_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=["a"] * 65, max_tokens=1)
    assert exc.value.body["param"] == "prompt"


def test_a_client_gone_mid_stream_ends_every_choice(server):
    """n streams share one connection: when it closes, every choice's engine request ends
    and its KV blocks are freed."""
    import time

    import httpx

    body = {"model": MODEL, "messages": QUESTION, "n": 4, "max_tokens": 400, "stream": True,
            "temperature": 1.0, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=60) as r:
        lines = r.iter_lines()
        seen = {int(line.split('"index": ')[1][0]) for line in
                (next(lines) for _ in range(12)) if '"index": ' in line}
        assert seen == {0, 1, 2, 3}
    deadline = time.monotonic() + 60
    while True:
        h = server.health()
        if h["in_flight"] == 0 and h["kv_free_blocks"] == h["kv_total_blocks"]:
            break
        assert time.monotonic() < deadline, h
        time.sleep(0.1)
