"""Structured output and tool calls through the real server and the OpenAI SDK: the grammar
step of the sampler keeps output inside the schema, even under heavy penalties."""

import asyncio
import json

import jsonschema
import pytest
from api_server import MODEL, KilnServer

S = {"type": "string", "maxLength": 24}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
                                                          "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
     "required": ["colour"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": S, "minItems": 1,
                                                "maxItems": 3}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"city": S, "location": {
        "type": "object", "properties": {"lat": {"type": "number", "minimum": -90,
                                                 "maximum": 90},
                                         "lon": {"type": "number", "minimum": -180,
                                                 "maximum": 180}},
        "required": ["lat", "lon"], "additionalProperties": False}},
     "required": ["city", "location"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {
        "type": "number", "minimum": 0, "maximum": 1}},
     "required": ["ok", "score"], "additionalProperties": False},
]
ASKS = ["Describe a person.", "Pick a colour.", "List a few fruits.", "Where is Paris?",
        "Rate this answer."]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": S, "unit": {
        "enum": ["celsius", "fahrenheit"]}}, "required": ["city"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": S}, "required": ["timezone"],
                   "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln-structured"), "--per-request-sampling") as s:
        yield s


def _json_schema(i: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i % 5],
                                                   "strict": True}}


def test_20_json_schema_requests_at_temperature_1_conform(server):
    async def main():
        client = server.async_client()
        return await asyncio.gather(*[client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": ASKS[i % 5] + " Answer in JSON."}],
            temperature=1.0, max_tokens=200, seed=i, response_format=_json_schema(i))
            for i in range(20)])

    replies = asyncio.run(main())
    stopped = 0
    for i, r in enumerate(replies):
        if r.choices[0].finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[i % 5])
    assert stopped >= 18


def test_json_object_output_always_parses_as_an_object(server):
    client = server.client()
    stopped = 0
    for seed in range(2):
        r = client.chat.completions.create(
            model=MODEL, temperature=0.5, seed=seed, max_tokens=80,
            messages=[{"role": "user", "content": "Reply with a JSON object with one key, "
                                                  "'name', for a cat."}],
            response_format={"type": "json_object"})
        assert r.choices[0].message.content.lstrip().startswith("{")
        if r.choices[0].finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert stopped


def test_constrained_output_survives_heavy_penalties(server):
    client = server.client()
    for i in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": ASKS[i]}], temperature=0.7,
            seed=i, max_tokens=200, presence_penalty=2.0, frequency_penalty=2.0,
            extra_body={"repetition_penalty": 2.0}, response_format=_json_schema(i))
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[i])


def _check_calls(message, names):
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments),
                            schema["function"]["parameters"])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_are_well_formed_and_stream_the_same(server, choice):
    client = server.client()
    kw = dict(model=MODEL, temperature=0, max_tokens=100, tools=[WEATHER, TIME],
              tool_choice=choice,
              messages=[{"role": "user", "content": "What's the weather in Paris right now?"}])
    r = client.chat.completions.create(**kw)
    names = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message, names)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": "", "arguments": ""})
            c["name"] += (d.function.name or "") if d.function else ""
            c["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments))
         for c in r.choices[0].message.tool_calls]


def test_a_multi_turn_tool_conversation_renders_and_runs(server):
    client = server.client()
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                           tool_choice="required", temperature=0, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "clear"}'}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                            temperature=0, max_tokens=40)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
], ids=["bad-schema", "tool-without-name", "unknown-function", "unknown-format"])
def test_bad_structured_input_is_a_400_naming_the_field(server, body, param):
    for stream in (False, True):
        r = server.post("/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
            **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["param"] is not None and err["param"].startswith(param.split(".")[0])
