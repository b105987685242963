"""Every example of request-parameters.md, run against a real `kiln serve` with the official
OpenAI SDK (smollm2:135m in place of the page's model), and the behaviour the page states
around it: extra_body sampling fields, repeat_last_n, seed repeatability,
continue_final_message."""

import os

import pytest
from api_server import FP32, MODEL, KilnServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPEAT = "Write the word 'hello' twenty times, separated by spaces."
DRAGON = [{"role": "user", "content": "Invent a name for a pet dragon."}]
PARIS = [{"role": "user", "content": "Is Paris the capital of France? Answer yes or no."},
         {"role": "assistant", "content": "The answer is:"}]
DRAGON_REST = {"top_k": 40, "min_p": 0.0, "repetition_penalty": 1.0, "repeat_last_n": 64}
NO_PENALTIES = dict(presence_penalty=0, frequency_penalty=0,
                    extra_body={"repetition_penalty": 1.0, "repeat_last_n": 64})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln-examples"), *FP32) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def say(client, content, **kw) -> str:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                "content": content}], **kw)
    return r.choices[0].message.content


# --- Sampling Fields ---

def test_sampling_fields_example_runs_and_applies_every_field(server, client):
    mark = server.log_mark()
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "List ten animals, no repeats."}],
        temperature=0.7,
        top_p=0.8,
        presence_penalty=1.5,
        extra_body={"top_k": 20, "repetition_penalty": 1.0},
        max_tokens=6,
    )
    content = response.choices[0].message.content
    assert isinstance(content, str) and content.strip()
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.usage.completion_tokens <= 6
    assert "Ignoring" not in server.log_since(mark)  # every value was in range: all applied


def test_extra_body_top_k_is_read(client):
    # top_k=1 is greedy whatever the temperature: only if the server reads extra_body's top_k.
    greedy = say(client, "Name a colour.", temperature=0, max_tokens=6, **NO_PENALTIES)
    top1 = say(client, "Name a colour.", temperature=1.5, max_tokens=6, presence_penalty=0,
               frequency_penalty=0, extra_body={"top_k": 1, "repetition_penalty": 1.0})
    assert top1 == greedy


def test_extra_body_repetition_penalty_is_read(client):
    plain = say(client, REPEAT, temperature=0, max_tokens=8, **NO_PENALTIES)
    penalised = say(client, REPEAT, temperature=0, max_tokens=8, presence_penalty=0,
                    frequency_penalty=0, extra_body={"repetition_penalty": 3.0})
    assert plain.lower().count("hello") >= 3
    assert penalised != plain


# --- The Penalty Window ---

def test_repeat_last_n_example_runs(server, client):
    mark = server.log_mark()
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user",
                   "content": "Write a 500-word story without repeating an adjective."}],
        presence_penalty=1.0,
        extra_body={"repeat_last_n": -1},   # penalise repeats across the whole reply
        max_tokens=4,
    )
    assert response.choices[0].message.content.strip()
    assert "Ignoring" not in server.log_since(mark)


def test_repeat_last_n_zero_turns_penalties_off_and_minus_one_keeps_them(client):
    base = dict(temperature=0, max_tokens=8, frequency_penalty=0)
    plain = say(client, REPEAT, presence_penalty=0,
                extra_body={"repetition_penalty": 1.0, "repeat_last_n": 64}, **base)
    off = say(client, REPEAT, presence_penalty=2.0,
              extra_body={"repetition_penalty": 1.0, "repeat_last_n": 0}, **base)
    whole = say(client, REPEAT, presence_penalty=2.0,
                extra_body={"repetition_penalty": 1.0, "repeat_last_n": -1}, **base)
    assert off == plain
    assert whole != plain
    # Ollama-style options.repeat_last_n is not read: the stored -1 still applies.
    ollama = say(client, REPEAT, presence_penalty=2.0,
                 extra_body={"repetition_penalty": 1.0, "options": {"repeat_last_n": 0}},
                 **base)
    assert ollama == whole


# --- seed and Repeatable Output ---

def dragon(client, seed, stream=False, max_tokens=8):
    kw = dict(model=MODEL, messages=DRAGON, temperature=0.8, top_p=0.9, presence_penalty=0,
              frequency_penalty=0, seed=seed, max_tokens=max_tokens, extra_body=DRAGON_REST)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_seed_example_repeats_streamed_or_not_and_ignores_unseeded_requests(client):
    # The example pins temperature, top_p and the two penalties; pin the other sticky
    # fields first, as the page advises, so earlier tests' values (top_k=1) don't apply.
    say(client, "Hi", max_tokens=1, extra_body=DRAGON_REST)
    response = client.chat.completions.create(
        model=MODEL,
        messages=DRAGON,
        temperature=0.8,
        top_p=0.9,
        presence_penalty=0,     # send every sampling field: they stick across requests
        frequency_penalty=0,
        seed=42,
        max_tokens=8,
    )
    first = response.choices[0].message.content
    assert first and first == dragon(client, 42)
    # An unseeded request (sampled with the stored settings) draws from the shared
    # generator in between...
    say(client, "Tell me a joke.", max_tokens=3)
    # ...and the seeded request still repeats, streamed and not.
    assert dragon(client, 42) == first
    assert dragon(client, 42, stream=True) == first
    assert dragon(client, 43) != first  # the seed, not luck, fixes the text


def test_seed_repeats_on_completions_with_64_bit_seeds(client):
    def complete(seed, stream=False):
        kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0.9,
                  top_p=1.0, presence_penalty=0, frequency_penalty=0, seed=seed,
                  extra_body={"top_k": 1000, "min_p": 0.0, "repetition_penalty": 1.0})
        if not stream:
            return client.completions.create(**kw).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                       if c.choices)

    low, high = -(2**63), 2**63 - 1
    first = complete(low)
    client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3)  # unseeded
    assert complete(low) == first
    assert complete(low, stream=True) == first
    assert complete(high) != first


# --- Continuing an Assistant Message ---

@pytest.fixture(scope="module")
def hf_continuation_ids(smollm2_gguf):
    """transformers' own continue_final_message prompt for PARIS, as token ids (the oracle)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    path = Path(smollm2_gguf)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = tok.apply_chat_template(PARIS, tokenize=False, continue_final_message=True)
    assert text.endswith("The answer is:")
    return tok.encode(text, add_special_tokens=False)


def test_continue_final_message_example(client, hf_continuation_ids):
    response = client.chat.completions.create(
        model=MODEL,
        messages=PARIS,
        max_tokens=1,
        temperature=0,  # a sampled token may lie outside the top 5 it is checked against
        logprobs=True,
        top_logprobs=5,
        extra_body={"continue_final_message": True},
    )
    choice = response.choices[0]
    first = choice.logprobs.content[0]
    assert len(choice.logprobs.content) == 1  # only the continued token has an entry
    assert choice.message.content == first.token  # content is only the continuation
    assert first.token.startswith(" ")  # whitespace kept as the model wrote it
    assert response.usage.prompt_tokens == len(hf_continuation_ids)  # includes the text
    assert response.usage.completion_tokens == 1
    # The first entry is the distribution right after the text: the same as a plain
    # completion of transformers' continue_final_message prompt.
    ref = client.completions.create(model=MODEL, prompt=hf_continuation_ids, max_tokens=1,
                                    temperature=0, logprobs=5).choices[0].logprobs
    tops = [(t.token, t.logprob) for t in first.top_logprobs]
    assert [t for t, _ in tops] == list(ref.top_logprobs[0])
    for token, logprob in tops:
        assert logprob == pytest.approx(ref.top_logprobs[0][token], abs=2e-3)
    assert first.logprob == pytest.approx(dict(tops)[first.token], abs=1e-6)


def test_continue_final_message_returns_only_the_continuation(client, hf_continuation_ids):
    kw = dict(model=MODEL, messages=PARIS, max_tokens=4, temperature=0, logprobs=True,
              extra_body={"continue_final_message": True})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].message.content
    entries = r.choices[0].logprobs.content
    ref = client.completions.create(model=MODEL, prompt=hf_continuation_ids, max_tokens=4,
                                    temperature=0).choices[0].text
    assert content == ref
    assert "The answer is" not in content
    assert len(entries) == r.usage.completion_tokens
    assert "".join(e.token for e in entries) == content
    streamed = client.chat.completions.create(stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == content
