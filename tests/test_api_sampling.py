"""Sticky sampling settings over HTTP (contract.md, "Sticky settings"): a request's valid values
stay for later requests that don't send them, POST /api/load restores the model's defaults,
and GET /v1/models shows each model's defaults and context length."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from api_server import MODEL, KilnServer

PROMPT = "Write a short line about the sea."
# Settings loose enough that sampling from them visibly differs from the defaults.
LOOSE = dict(temperature=1.5, top_p=1.0, extra_body={"top_k": 1000, "min_p": 0.0,
                                                     "repetition_penalty": 1.0})
DEFAULTS = {
    "smollm2:135m": {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "min_p": 0.1,
                     "presence_penalty": 0.0, "frequency_penalty": 0.0,
                     "repetition_penalty": 1.1, "repeat_last_n": 64},
    "gemma3:270m": {"temperature": 1.0, "top_p": 0.95, "top_k": 64, "min_p": 0.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0,
                    "repetition_penalty": 1.0, "repeat_last_n": 64},
    "qwen2.5-coder:0.5b": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0,
                           "presence_penalty": 0.0, "frequency_penalty": 0.0,
                           "repetition_penalty": 1.1, "repeat_last_n": 64},
}
CONTEXT = {"smollm2:135m": 8192, "gemma3:270m": 32768, "qwen2.5-coder:0.5b": 32768}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln-sampling")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def say(client, max_tokens=6, **kw) -> str:
    r = client.chat.completions.create(model=MODEL, max_tokens=max_tokens,
                                       messages=[{"role": "user", "content": PROMPT}], **kw)
    return r.choices[0].message.content


def explicit_defaults() -> dict:
    d = DEFAULTS[MODEL]
    return dict(temperature=d["temperature"], top_p=d["top_p"],
                presence_penalty=d["presence_penalty"],
                frequency_penalty=d["frequency_penalty"],
                extra_body={k: d[k] for k in ("top_k", "min_p", "repetition_penalty",
                                              "repeat_last_n")})


def test_temperature_zero_sticks_for_a_request_that_sends_nothing(client):
    say(client, max_tokens=1, **LOOSE)  # stored: temperature 1.5 and friends
    sent = say(client, temperature=0)  # A
    unsent = say(client)  # B sends no sampling field: greedy too, from the stored 0
    assert unsent == sent
    assert say(client, temperature=0) == sent


def test_every_sampling_field_sticks_and_seed_does_not_pin_them(client):
    say(client, max_tokens=1, **LOOSE)
    # Only temperature and seed sent: top_p, top_k, min_p, repetition_penalty are the stored
    # loose ones, so the text equals the fully explicit loose request.
    partial = say(client, temperature=1.5, seed=11)
    assert partial == say(client, seed=11, **LOOSE)
    assert partial != say(client, seed=11, **dict(explicit_defaults(), temperature=1.5))


def test_api_load_restores_the_defaults(server, client):
    say(client, max_tokens=1, **LOOSE)
    loose = say(client, seed=5)
    mark = server.log_mark()
    with ThreadPoolExecutor(1) as pool:
        reload = pool.submit(httpx.post, f"{server.url}/api/load", json={"model": MODEL},
                             timeout=300)
        time.sleep(0.5)
        assert "Serving" not in server.log_since(mark)  # the reload is still under way
        # A request that arrives during the reload waits for it, then gets the defaults.
        during = say(client, seed=5)
        r = reload.result()
    assert r.status_code == 200
    assert r.json() == {"status": "loaded", "model": MODEL, "defaults": DEFAULTS[MODEL]}
    log = server.log_since(mark)
    assert log.index("Serving") < log.index("Prefill chunk")
    assert during == say(client, seed=5) == say(client, seed=5, **explicit_defaults())
    assert during != loose


def test_models_lists_defaults_and_context_length(client):
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(cards) == set(DEFAULTS)
    for tag, card in cards.items():
        assert card["object"] == "model"
        assert card["defaults"] == DEFAULTS[tag]
        assert card["context_length"] == CONTEXT[tag]
        assert card["loaded"] is (tag == MODEL)
