"""The operational routes against a real `kiln serve` (--ctx-len 512):

- /tokenize and /detokenize (vLLM's shapes) against transformers' tokenizer on the same GGUF;
  the chat form gives the very prompt the chat route reads (its usage.prompt_tokens);
- GET /tokenizer_info (vLLM's shape, what lm-eval's remote tokenizer reads): the special
  tokens and chat template transformers reads from the same GGUF;
- GET /v1/models/{id} through the OpenAI SDK, 404 -> openai.NotFoundError;
- /metrics read with prometheus_client's own parser: counters move by what the requests'
  usage blocks say, and the KV gauges return to idle;
- no input to these routes is a 5xx (a hypothesis fuzz).
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from api_server import MODEL, KilnServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

CTX = 512
PROMPTS = ["Hello world", "  two  spaces\tand a tab\n", "héllo wörld, 你好 🙂",
           "<|im_start|>user\nhi<|im_end|>", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln-ops"), "--ctx-len", str(CTX)) as s:
        yield s


@pytest.fixture(scope="module")
def hf_tok(smollm2_gguf):
    from pathlib import Path

    from transformers import AutoTokenizer

    path = Path(smollm2_gguf)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def hf_chat_ids(hf_tok, messages: list[dict], add_special_tokens: bool = False,
                **kw) -> list[int]:
    """transformers' apply_chat_template: the rendered text, encoded."""
    text = hf_tok.apply_chat_template(messages, tokenize=False, **kw)
    return hf_tok(text, add_special_tokens=add_special_tokens)["input_ids"]


def post_ok(server: KilnServer, path: str, body: dict) -> dict:
    r = server.post(path, body)
    assert r.status_code == 200, r.text
    return r.json()


def assert_400(r: httpx.Response, param: str | None = None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# --- /tokenize and /detokenize --------------------------------------------------------------

@pytest.mark.parametrize("prompt", PROMPTS)
def test_tokenize_matches_the_models_tokenizer(server, hf_tok, prompt):
    body = post_ok(server, "/tokenize", {"model": MODEL, "prompt": prompt,
                                         "return_token_strs": True})
    expected = hf_tok(prompt)["input_ids"]
    assert body == {"count": len(expected), "max_model_len": CTX, "tokens": expected,
                    "token_strs": hf_tok.convert_ids_to_tokens(expected)}
    plain = post_ok(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False})
    assert plain["tokens"] == hf_tok(prompt, add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] is None


@pytest.mark.parametrize("prompt", PROMPTS)
def test_detokenize_round_trips(server, hf_tok, prompt):
    ids = post_ok(server, "/tokenize", {"prompt": prompt})["tokens"]
    text = post_ok(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert text == {"prompt": hf_tok.decode(ids)}
    assert text["prompt"] == prompt


def test_chat_form_is_the_prompt_the_chat_route_reads(server, hf_tok):
    body = post_ok(server, "/tokenize", {"model": MODEL, "messages": CHAT})
    assert body["tokens"] == hf_chat_ids(hf_tok, CHAT, add_generation_prompt=True)
    reply = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                                    temperature=0)
    assert body["count"] == reply.usage.prompt_tokens

    closed = post_ok(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert closed["tokens"] == hf_chat_ids(hf_tok, CHAT, add_generation_prompt=False)

    partial = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    cont = post_ok(server, "/tokenize", {"messages": partial, "continue_final_message": True})
    reply = server.client().chat.completions.create(
        model=MODEL, messages=partial, max_tokens=1, temperature=0,
        extra_body={"continue_final_message": True})
    assert cont["count"] == reply.usage.prompt_tokens
    assert cont["tokens"] == hf_chat_ids(hf_tok, partial, continue_final_message=True)

    special = post_ok(server, "/tokenize", {"messages": CHAT, "add_special_tokens": True})
    assert special["tokens"] == hf_chat_ids(hf_tok, CHAT, add_special_tokens=True,
                                            add_generation_prompt=True)


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
    ("/tokenize", {"prompt": "a", "model": 7}, "model"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": None}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": 3}]}, None),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True,
                   "add_generation_prompt": True}, "continue_final_message"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ("/detokenize", {"tokens": [[1]]}, "tokens"),
    ("/detokenize", {"tokens": [49152]}, "tokens"),
    ("/detokenize", {"tokens": [10**30]}, "tokens"),
])
def test_unusable_tokenize_input_is_a_400(server, path, body, param):
    assert_400(server.post(path, body), param)


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_a_body_that_is_not_a_json_object_is_a_400(server, path):
    for raw in (b"not json", b"[1, 2]", b'"x"'):
        assert_400(server.post(path, raw))


def test_tokenize_for_an_unknown_model_is_a_404(server):
    for path, body in (("/tokenize", {"model": "nope:1b", "prompt": "a"}),
                       ("/tokenize", {"model": "/etc/passwd", "messages": CHAT}),
                       ("/detokenize", {"model": "nope.gguf", "tokens": [1]})):
        r = server.post(path, body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# --- /tokenizer_info ------------------------------------------------------------------------

def test_tokenizer_info_names_the_tokens_transformers_reads_from_the_gguf(server, hf_tok):
    r = httpx.get(f"{server.url}/tokenizer_info", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "tokenizer_class": "Tokenizer", "bos_token": hf_tok.bos_token,
        "eos_token": hf_tok.eos_token, "pad_token": hf_tok.pad_token,
        "unk_token": hf_tok.unk_token, "add_bos_token": hf_tok.add_bos_token,
        "add_eos_token": False, "model_max_length": CTX, "chat_template": hf_tok.chat_template}
    # lm-eval's remote tokenizer takes a token's id as the first of its /tokenize ids.
    for token in ("bos_token", "eos_token"):
        ids = post_ok(server, "/tokenize", {"prompt": r.json()[token],
                                            "add_special_tokens": False})["tokens"]
        assert ids == [getattr(hf_tok, f"{token}_id")]


def test_tokenizer_info_refuses_parameters_and_other_methods_in_openais_shape(server):
    r = httpx.get(f"{server.url}/tokenizer_info", params={"model": MODEL}, timeout=30)
    err = assert_400(r, "model")
    assert err["code"] == "unknown_parameter" and "takes no parameters" in err["message"]
    r = server.post("/tokenizer_info", {})
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


# --- /v1/models/{id} ------------------------------------------------------------------------

def test_retrieve_model_is_the_card_the_list_shows(server):
    client = server.client()
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    for model_id in (MODEL, "gemma3:270m"):
        card = client.models.retrieve(model_id).model_dump()
        assert {**card, "created": 0} == {**listed[model_id], "created": 0}
    assert client.models.retrieve(MODEL).model_dump()["context_length"] == CTX


@pytest.mark.parametrize("model_id", ["nope:1b", "smollm2", "/etc/passwd", "../smollm2:135m",
                                      "smollm2:135m/x", "x" * 300])
def test_retrieve_an_unknown_model_is_a_404(server, model_id):
    with pytest.raises(openai.NotFoundError) as err:
        server.client().models.retrieve(model_id)
    assert err.value.body["code"] == "model_not_found"
    assert model_id not in err.value.body["message"]


# --- /metrics -------------------------------------------------------------------------------

def scrape(server: KilnServer) -> dict[str, float]:
    """Every sample, by name and labels: `name{a="x",b="y"}`."""
    r = httpx.get(f"{server.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_metrics_count_what_the_requests_did(server):
    client = server.client()
    before = scrape(server)
    usages, finished = [], 0
    for n in (3, 5):  # the same prompt twice: the second reads the first's blocks
        r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=n,
                                           temperature=0)
        usages.append(r.usage)
        finished += 1
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4,
                                       seed=1, stream=True,
                                       stream_options={"include_usage": True})
    usages += [c.usage for c in stream if c.usage is not None]
    finished += 1
    assert server.post("/v1/chat/completions", {"model": "nope:1b", "messages": CHAT}
                       ).status_code == 404
    deadline = time.monotonic() + 60
    while True:  # the engine frees the last blocks just after the last response
        after = scrape(server)
        if after["kiln:kv_blocks_free"] == after["kiln:kv_blocks_total"] \
                and after["kiln:num_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.1)

    assert len(usages) == 3
    assert delta(before, after, "kiln:generation_tokens_total") == \
        sum(u.completion_tokens for u in usages)
    assert delta(before, after, "kiln:prompt_tokens_total") == \
        sum(u.prompt_tokens for u in usages)
    assert delta(before, after, "kiln:prefix_cache_queries_total") == \
        sum(u.prompt_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert cached > 0 and delta(before, after, "kiln:prefix_cache_hits_total") == cached
    assert delta(before, after, 'kiln:request_success_total{finished_reason="length"}') == 3
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "time_per_output_token_seconds"):
        assert delta(before, after, f"kiln:{hist}_count") == finished
        assert delta(before, after, f"kiln:{hist}_sum") > 0
        assert delta(before, after, f'kiln:{hist}_bucket{{le="+Inf"}}') == finished
    route = 'kiln:http_requests_total{method="POST",route="/v1/chat/completions",status="%s"}'
    assert delta(before, after, route % "200") == 2
    assert delta(before, after, route % "404") == 1
    assert delta(before, after, 'kiln:http_requests_total{method="POST",'
                                'route="/v1/completions",status="200"}') == 1
    assert after["kiln:kv_blocks_used"] == 0 and after["kiln:kv_blocks_total"] > 0
    assert after["kiln:num_requests_waiting"] == 0
    assert after["kiln:num_preemptions_total"] == before.get("kiln:num_preemptions_total", 0)
    health = server.health()
    assert (health["kv_free_blocks"], health["kv_total_blocks"]) == \
        (after["kiln:kv_blocks_free"], after["kiln:kv_blocks_total"])


# --- no 5xx ---------------------------------------------------------------------------------

json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
FIELDS = {
    "model": st.sampled_from([MODEL, "", "/etc/passwd", "../x.gguf"]) | json_value,
    "prompt": st.text(max_size=20) | json_value,
    "messages": st.just(CHAT) | st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system"]) | json_value,
         "content": st.text(max_size=10) | json_value}), max_size=3) | json_value,
    "tokens": st.lists(st.integers(-5, 60000), max_size=6) | json_value,
    "add_special_tokens": json_value, "add_generation_prompt": json_value,
    "continue_final_message": json_value, "return_token_strs": json_value,
    "tools": json_value,
}


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/tokenize", "/detokenize"]),
       body=st.fixed_dictionaries({}, optional=FIELDS))
def test_no_tokenize_input_is_a_5xx(server, path, body):
    r = server.post(path, body)
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["message"]
