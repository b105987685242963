"""Ollama's API on a real `kiln serve`, driven through the official `ollama` Python client.

The oracles: the same request through the OpenAI SDK on /v1 (seeded or greedy, so the text
must be the same), the catalogue and the files in the kiln cache (sizes, sha256), jsonschema
for structured output, and Ollama's documented shapes as the client parses them."""

import hashlib
import json
from datetime import datetime, timezone

import httpx
import jsonschema
import ollama
import pytest
from api_server import MODEL, KilnServer

from kiln.api.protocol.chat import ResponseFormat
from kiln.api.protocol.ollama import chat_request, generate_request
from kiln.runtime.engine.engine_request import RequestOptions
from kiln.runtime.errors import InvalidRequestError, ModelNotFoundError
from kiln.runtime.sampling.settings import SamplingFields
from kiln.runtime.store.catalogue import CATALOGUE
from kiln.runtime.store.pull import is_pulled, model_path

ENTRY = CATALOGUE[MODEL]
# Every sampling field, on both APIs: settings stick, so a comparison sends them all; a seed
# also starts the penalty window empty (contract.md).
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "seed": 7}
OPTIONS = {**SAMPLING, "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1, "repeat_last_n": 64,
           "num_predict": 8}
V1 = {**SAMPLING, "max_tokens": 8,
      "extra_body": {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
                     "repeat_last_n": 64}}
GREEDY_OPTIONS = {**OPTIONS, "temperature": 0.0}
GREEDY_V1 = {**V1, "temperature": 0.0}
DRAGON = [{"role": "user", "content": "Invent a name for a pet dragon."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# SmolLM2-135M does not call a tool of its own accord; it does repeat a call it is shown.
REPEAT_CALL = [{"role": "user", "content": 'Repeat after me: <tool_call>[\n{"name": '
                '"get_weather", "arguments": {"city": "Tokyo"}}\n]</tool_call>'}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln-ollama")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=120)


@pytest.fixture(scope="module")
def openai(server):
    return server.client()


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# --- models ---

def test_list_shows_the_pulled_catalogue_models(client):
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {tag for tag, e in CATALOGUE.items() if is_pulled(e)}
    for tag, m in listed.items():
        entry = CATALOGUE[tag]
        assert m.size == entry.size == model_path(entry).stat().st_size
        assert m.digest == entry.sha256
        assert m.details.format == "gguf"
        assert m.details.family == entry.arch and m.details.families == [entry.arch]
        assert m.modified_at.timestamp() == pytest.approx(model_path(entry).stat().st_mtime)
    # README's catalogue: SmolLM2-135M-Instruct, Q4_1
    assert listed[MODEL].details.quantization_level == "Q4_1"
    assert listed[MODEL].details.parameter_size.endswith("M")
    assert 134 <= float(listed[MODEL].details.parameter_size[:-1]) <= 136


def test_show_gives_the_template_defaults_and_gguf_metadata(client, openai):
    shown = client.show(MODEL)
    d = ENTRY.defaults
    params = dict(line.split(None, 1) for line in shown.parameters.splitlines())
    assert {k: float(v) for k, v in params.items()} == {
        "num_ctx": next(m for m in openai.models.list().data if m.id == MODEL)
        .model_extra["context_length"],
        "temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k, "min_p": d.min_p,
        "presence_penalty": d.presence_penalty, "frequency_penalty": d.frequency_penalty,
        "repeat_penalty": d.repetition_penalty, "repeat_last_n": d.repeat_last_n}
    assert "<|im_start|>" in shown.template and "messages" in shown.template  # SmolLM2's ChatML
    assert f'TEMPLATE """{shown.template}"""' in shown.modelfile
    info = shown.modelinfo
    assert info["general.architecture"] == "llama"
    assert info["llama.context_length"] == ENTRY.ctx_len
    assert info["llama.embedding_length"] == 576  # SmolLM2-135M's hidden size
    assert info["tokenizer.ggml.tokens"] == []  # Ollama leaves the vocabulary out
    assert "tokenizer.chat_template" not in info
    assert {"completion", "tools"} <= set(shown.capabilities)
    assert shown.details.quantization_level == "Q4_1"


def test_ps_shows_the_loaded_model(client, openai):
    (m,) = client.ps().models
    assert m.model == m.name == MODEL
    assert m.digest == ENTRY.sha256
    assert m.size > ENTRY.size  # the weights and the KV cache
    assert m.size_vram == 0  # served on the CPU
    assert m.expires_at > datetime.now(timezone.utc)
    assert m.context_length == next(c for c in openai.models.list().data
                                    if c.id == MODEL).model_extra["context_length"]


def test_version_answers(server):
    r = httpx.get(f"{server.url}/api/version")
    assert r.status_code == 200
    major, minor, _ = (int(x) for x in r.json()["version"].split("."))
    assert (major, minor) >= (0, 5)  # clients gate structured outputs on 0.5


# --- chat ---

def test_seeded_chat_streams_and_matches_v1(client, openai):
    whole = client.chat(model=MODEL, messages=DRAGON, options=OPTIONS, stream=False)
    parts = list(client.chat(model=MODEL, messages=DRAGON, options=OPTIONS, stream=True))
    v1 = openai.chat.completions.create(model=MODEL, messages=DRAGON, **V1)
    text = v1.choices[0].message.content
    assert whole.message.role == "assistant"
    assert whole.message.content == "".join(p.message.content for p in parts) == text
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    for r in (whole, parts[-1]):
        assert r.done_reason == v1.choices[0].finish_reason
        assert r.prompt_eval_count == v1.usage.prompt_tokens
        assert r.eval_count == v1.usage.completion_tokens
        assert r.total_duration >= r.prompt_eval_duration + r.eval_duration > 0


def test_greedy_chat_matches_v1_and_logprobs_agree(client, openai):
    r = client.chat(model=MODEL, messages=DRAGON, options=GREEDY_OPTIONS, logprobs=True,
                    top_logprobs=2)
    v1 = openai.chat.completions.create(model=MODEL, messages=DRAGON, logprobs=True,
                                        top_logprobs=2, **GREEDY_V1)
    assert r.message.content == v1.choices[0].message.content
    assert [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs])
            for lp in r.logprobs] == \
        [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs])
         for lp in v1.choices[0].logprobs.content]


def test_a_stream_is_ndjson_by_default(server):
    body = {"model": MODEL, "messages": DRAGON, "options": GREEDY_OPTIONS}
    with httpx.stream("POST", f"{server.url}/api/chat", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) > 2 and lines[-1]["done"] is True
    assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 8


def test_a_format_schema_constrains_the_reply(client):
    r = client.chat(model=MODEL, format=PERSON, options={**OPTIONS, "num_predict": 40},
                    messages=[{"role": "user", "content": "Describe a person in JSON."}])
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), PERSON)


def test_a_tool_call_comes_back_with_object_arguments(client, openai):
    r = client.chat(model=MODEL, messages=REPEAT_CALL, tools=[WEATHER], options=GREEDY_OPTIONS
                    | {"num_predict": 40})
    v1 = openai.chat.completions.create(model=MODEL, messages=REPEAT_CALL, tools=[WEATHER],
                                        **GREEDY_V1 | {"max_tokens": 40})
    expected = [(c.function.name, json.loads(c.function.arguments))
                for c in v1.choices[0].message.tool_calls]
    assert expected == [("get_weather", {"city": "Tokyo"})]
    assert [(c.function.name, c.function.arguments) for c in r.message.tool_calls] == expected
    assert r.done_reason == "stop" and r.message.content == (v1.choices[0].message.content or "")
    jsonschema.validate(r.message.tool_calls[0].function.arguments,
                        WEATHER["function"]["parameters"])
    streamed = [c for p in client.chat(model=MODEL, messages=REPEAT_CALL, tools=[WEATHER],
                                       options=GREEDY_OPTIONS | {"num_predict": 40},
                                       stream=True)
                for c in (p.message.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in streamed] == expected


def test_a_tool_conversation_reads_like_its_v1_twin(client, openai):
    """Ollama's history (arguments as an object, the result named by tool_name) renders to
    the same prompt as OpenAI's (arguments as JSON text, tool_call_id)."""
    ollama_msgs = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": '{"temp_c": 18}'}]
    v1_msgs = [
        ollama_msgs[0],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'}]
    r = client.chat(model=MODEL, messages=ollama_msgs, tools=[WEATHER], options=GREEDY_OPTIONS)
    v1 = openai.chat.completions.create(model=MODEL, messages=v1_msgs, tools=[WEATHER],
                                        **GREEDY_V1)
    assert r.prompt_eval_count == v1.usage.prompt_tokens
    assert r.message.content == (v1.choices[0].message.content or "")


# --- generate ---

def test_raw_generate_is_v1_completions(client, openai):
    prompt = "The capital of France is"
    r = client.generate(model=MODEL, prompt=prompt, raw=True, options=GREEDY_OPTIONS)
    parts = list(client.generate(model=MODEL, prompt=prompt, raw=True, options=GREEDY_OPTIONS,
                                 stream=True))
    v1 = openai.completions.create(model=MODEL, prompt=prompt, **GREEDY_V1)
    assert r.response == "".join(p.response for p in parts) == v1.choices[0].text
    assert r.prompt_eval_count == v1.usage.prompt_tokens
    assert r.done_reason == parts[-1].done_reason == v1.choices[0].finish_reason


def test_raw_generate_takes_a_format_schema(client):
    r = client.generate(model=MODEL, prompt="A person, as JSON:", raw=True, format=PERSON,
                        options={**GREEDY_OPTIONS, "num_predict": 40})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.response), PERSON)


def test_templated_generate_is_a_chat_turn(client, openai):
    system, prompt = "You are a poet.", "Write about the sea."
    r = client.generate(model=MODEL, prompt=prompt, system=system, options=OPTIONS)
    v1 = openai.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": prompt}], **V1)
    assert r.response == v1.choices[0].message.content
    assert r.prompt_eval_count == v1.usage.prompt_tokens


def test_an_empty_prompt_or_no_messages_loads_the_model(client):
    r = client.generate(model=MODEL, prompt="")
    assert (r.done, r.done_reason, r.response) == (True, "load", "")
    r = client.chat(model=MODEL, messages=[])
    assert (r.done, r.done_reason, r.message.content) == (True, "load", "")


# --- pull ---

def test_pull_of_a_present_model_streams_progress_then_success(client):
    events = list(client.pull(MODEL, stream=True))
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "verifying sha256 digest" in statuses
    progress = [e for e in events if e.digest]
    assert progress and progress[-1].completed == progress[-1].total == ENTRY.size
    assert progress[-1].digest == "sha256:" + _sha256(model_path(ENTRY))
    assert client.pull(MODEL, stream=False).status == "success"


def test_pull_of_an_unknown_tag_is_a_404(client):
    for stream in (True, False):
        with pytest.raises(ollama.ResponseError) as e:
            r = client.pull("no-such-model:1b", stream=stream)
            list(r) if stream else None  # (a stream raises on its first read)
        assert e.value.status_code == 404


# --- errors ---

@pytest.mark.parametrize("call", [
    lambda c: c.chat(model="no-such-model:1b", messages=DRAGON),
    lambda c: c.generate(model="no-such-model:1b", prompt="hi"),
    lambda c: c.show("no-such-model:1b"),
    lambda c: c.show("/etc/passwd"),
], ids=["chat", "generate", "show", "show-a-path"])
def test_an_unknown_model_is_a_404(client, call):
    with pytest.raises(ollama.ResponseError) as e:
        call(client)
    assert e.value.status_code == 404
    # One message for every unknown name: it echoes none (no oracle for the server's files).
    assert e.value.error == ModelNotFoundError.MESSAGE


@pytest.mark.parametrize("options,name", [
    ({"temperature": "hot"}, "options.temperature"),
    ({"top_k": 2.5}, "options.top_k"),
    ({"num_predict": "8"}, "options.num_predict"),
    ({"seed": True}, "options.seed"),
    ({"stop": [1, 2]}, "options.stop"),
    ({"num_ctx": "big"}, "options.num_ctx"),
    ({"repeat_last_n": -5}, "repeat_last_n"),
    ({"num_predict": -3}, "options.num_predict"),
])
def test_bad_options_are_a_400_naming_the_option(client, options, name):
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as e:
            r = client.chat(model=MODEL, messages=DRAGON, options=options, stream=stream)
            list(r) if stream else None
        assert e.value.status_code == 400 and name in e.value.error


@pytest.mark.parametrize("body", [
    {"model": MODEL, "prompt": "hi", "images": ["aGk="]},
    {"model": MODEL, "prompt": "hi", "suffix": "end"},
    {"model": MODEL, "prompt": "hi", "format": "yaml"},
    {"model": MODEL, "prompt": "hi", "raw": True, "system": "x"},
    {"model": MODEL, "prompt": "hi", "think": "very"},
    {"prompt": "hi"},
], ids=["images", "suffix", "format", "raw-system", "think", "no-model"])
def test_unusable_generate_input_is_a_400_in_ollamas_shape(server, body):
    r = server.post("/api/generate", body)
    assert r.status_code == 400
    assert isinstance(r.json()["error"], str) and r.json()["error"]


def test_out_of_range_options_are_ignored_with_a_warning(server, client):
    mark = server.log_mark()
    r = client.chat(model=MODEL, messages=DRAGON, options={**GREEDY_OPTIONS,
                                                          "temperature": -1.0})
    assert r.done
    assert "Ignoring temperature=-1.0" in server.log_since(mark)


def test_error_shapes_follow_the_route(server):
    r = httpx.post(f"{server.url}/api/embed", json={"model": MODEL, "input": "x"})
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    r = server.post("/api/chat", b"{not json")
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    r = server.post("/api/load", {})  # kiln's own route keeps OpenAI's shape
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


# --- the request translation, without a server ---

@pytest.mark.parametrize("num_predict,max_tokens", [(5, 5), (-1, None), (-2, None), (0, None),
                                                    (3.0, 3)])
def test_num_predict_is_max_tokens_and_negative_means_no_limit(num_predict, max_tokens):
    req = chat_request({"model": MODEL, "messages": DRAGON,
                        "options": {"num_predict": num_predict}})
    assert req.chat.options.max_tokens == max_tokens


def test_options_map_onto_kilns_fields_and_runner_options_are_dropped():
    req = chat_request({"model": MODEL, "messages": DRAGON, "think": "high", "options": {
        "repeat_penalty": 1.2, "repeat_last_n": 32, "stop": ["\n"], "top_k": 5,
        "num_ctx": 4096, "mirostat": 2, "unknown": "x"}})
    assert req.stream is True  # Ollama streams unless told not to
    assert req.chat.sampling == SamplingFields(
        repetition_penalty=1.2, repeat_last_n=32, top_k=5, think=True, reasoning_effort="high")
    assert req.chat.options == RequestOptions(stop=("\n",))
    assert chat_request({"model": MODEL, "messages": DRAGON, "format": "json"}).chat \
        .response_format == ResponseFormat("json_object")
    raw = generate_request({"model": MODEL, "prompt": "x", "raw": True, "format": "json",
                            "stream": False, "logprobs": True, "top_logprobs": 3})
    assert raw.raw and not raw.stream and raw.top_logprobs == 3
    # A raw prompt is a completion request: no template, so no thinking switches either.
    assert raw.raw_format == ResponseFormat("json_object") and raw.chat is None
    assert raw.completion.sampling == SamplingFields()
    with pytest.raises(InvalidRequestError, match="Images are not supported"):
        chat_request({"model": MODEL, "messages": [{"role": "user", "content": "x",
                                                    "images": ["aGk="]}]})
