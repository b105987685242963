"""POST /v1/responses (OpenAI's Responses API) through the official OpenAI SDK against a real
`kiln serve`: the SDK's own models parse every body and event; the chat route, given the same
messages and settings, is the oracle for the text and the usage; jsonschema checks
structured output and tool-call arguments."""

import asyncio
import json
import os

import httpx
import jsonschema
import openai
import pytest
from api_server import FP32, MODEL, KilnServer
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kiln.api.pipeline.assembler import Delta
from kiln.api.pipeline.reply import reply_events
from kiln.api.pipeline.responses_builder import ResponseBuilder, new_response
from kiln.api.protocol.responses import parse_responses_request
from kiln.api.routes.responses import ResponsesReply
from kiln.runtime.errors import RequestFailedError
from kiln.runtime.sampling.params import SamplingParams
from kiln.runtime.text.tool_parser import ToolCallDelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")

EVENT = TypeAdapter(ResponseStreamEvent)
PARIS = "What is the capital of France?"
GREEDY = dict(temperature=0, extra_body={"repetition_penalty": 1.0, "top_k": 40})
CITY = {"type": "string", "maxLength": 24}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}
TIME = {"type": "function", "name": "get_time", "description": "Current time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": CITY},
                       "required": ["timezone"], "additionalProperties": False}}
ASK_WEATHER = "What's the weather in Paris right now?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln-responses"), *FP32) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def paris(client):
    """The plain reply the streaming tests compare with (greedy, so any run gives it)."""
    return respond(client, PARIS, 12)


def chat(client, messages, max_tokens, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                          **GREEDY, **kw)


def respond(client, input, max_output_tokens, **kw):
    return client.responses.create(model=MODEL, input=input,
                                   max_output_tokens=max_output_tokens, **GREEDY, **kw)


def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    """(the `event:` name, the data) of every SSE frame, read without the SDK."""
    frames = []
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        text = "".join(r.iter_text())
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        frames.append((lines[0][7:], json.loads(lines[1][6:])))
    return frames


def message_event_types(n_deltas: int, end: str) -> list[str]:
    return ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added", *["response.output_text.delta"] * n_deltas,
            "response.output_text.done", "response.content_part.done",
            "response.output_item.done", end]


# --- text ---

def test_string_input_gives_the_chat_routes_reply_and_usage(server, client, paris):
    question = [{"role": "user", "content": PARIS}]
    expected = chat(client, question, 12)
    raw = server.post("/v1/responses", {"model": MODEL, "input": PARIS,
                                        "max_output_tokens": 12, "temperature": 0,
                                        "repetition_penalty": 1.0, "top_k": 40})
    assert raw.status_code == 200
    r = Response.model_validate(raw.json())  # strict: every field the SDK requires is there
    assert r.output_text == paris.output_text  # the SDK's request and a raw one agree
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == expected.choices[0].message.content
    assert r.status == "completed" and expected.choices[0].finish_reason == "stop"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.status == "completed"
    u, cu = r.usage, expected.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == \
        (cu.prompt_tokens, cu.completion_tokens, cu.total_tokens)
    assert u.output_tokens_details.reasoning_tokens == 0
    assert 0 <= u.input_tokens_details.cached_tokens < u.input_tokens
    # the request's settings are echoed, sampling as the request ran with it
    assert r.temperature == 0 and r.max_output_tokens == 12 and r.tools == []
    assert r.tool_choice == "auto" and r.parallel_tool_calls is True
    assert r.previous_response_id is None and r.error is None and r.text.format.type == "text"


def test_instructions_message_items_and_developer_role_read_as_chat_messages(client):
    turns = [("user", "Name a fruit."), ("assistant", "Apple."), ("user", "Name another.")]
    expected = chat(client, [{"role": "system", "content": "You are terse."},
                             {"role": "system", "content": "Answer in one word."}] +
                    [{"role": role, "content": text} for role, text in turns], 6)
    items = [{"type": "message", "role": "developer",
              "content": [{"type": "input_text", "text": "Answer in one word."}]},
             {"role": "user", "content": [{"type": "input_text", "text": turns[0][1]}]},
             {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
              "content": [{"type": "output_text", "text": turns[1][1], "annotations": []}]},
             {"role": "user", "content": turns[2][1]}]
    r = respond(client, items, 6, instructions="You are terse.")
    assert r.output_text == expected.choices[0].message.content
    assert r.usage.input_tokens == expected.usage.prompt_tokens
    assert r.instructions == "You are terse."


def test_seed_repeats_the_reply_streamed_or_not(client):
    kw = dict(model=MODEL, input="Invent a name for a pet dragon.", max_output_tokens=4,
              temperature=1.0, top_p=1.0, extra_body={"seed": 1234, "top_k": 40,
                                                      "min_p": 0.0, "repetition_penalty": 1.0})
    first = client.responses.create(**kw).output_text
    assert client.responses.create(**kw).output_text == first
    deltas = [e.delta for e in client.responses.create(**kw, stream=True)
              if e.type == "response.output_text.delta"]
    assert "".join(deltas) == first


def test_max_output_tokens_ends_the_reply_incomplete(client):
    r = respond(client, "Write a long story about a dragon.", 3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    assert r.output[0].status == "incomplete" and r.output_text


def test_logprobs_are_the_chat_routes(client):
    question = [{"role": "user", "content": PARIS}]
    expected = chat(client, question, 3, logprobs=True, top_logprobs=2)
    r = respond(client, PARIS, 3, include=["message.output_text.logprobs"], top_logprobs=2)
    got = r.output[0].content[0].logprobs
    want = expected.choices[0].logprobs.content
    assert [(g.token, g.bytes) for g in got] == [(w.token, w.bytes) for w in want]
    assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert [len(g.top_logprobs) for g in got] == [2] * len(want)


# --- streaming ---

def test_stream_events_come_in_order_and_add_up_to_the_reply(client, paris):
    plain = paris
    events = list(respond(client, PARIS, 12, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [e.type for e in events] == message_event_types(len(deltas), "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(deltas)
    assert text == plain.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.usage is None
    assert final.id == created.id and final.output_text == text and final.status == "completed"
    assert (final.usage.input_tokens, final.usage.output_tokens) == \
        (plain.usage.input_tokens, plain.usage.output_tokens)


def test_stream_helper_gives_the_final_response(client, paris):
    plain = paris
    with client.responses.stream(model=MODEL, input=PARIS, max_output_tokens=12,
                                 **GREEDY) as stream:
        snapshots = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == plain.output_text == snapshots[-1]
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_raw_stream_names_each_event_and_ends_without_done(server):
    frames = raw_events(server, {"model": MODEL, "input": PARIS, "max_output_tokens": 2,
                                 "stream": True, "temperature": 0})
    for name, data in frames:
        assert name == data["type"]
        EVENT.validate_python(data)  # strict: the SDK's model of that event
    deltas = sum(name == "response.output_text.delta" for name, _ in frames)
    assert [name for name, _ in frames] == message_event_types(deltas, "response.incomplete")
    assert frames[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


# --- structured output and tools ---

def test_text_format_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    r = respond(client, "Pick a colour.", 24, text={"format": {
        "type": "json_schema", "name": "colour", "schema": schema, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.schema_ == schema


def _check_call(item, names):
    assert item.type == "function_call" and item.name in names and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")
    schema = {"get_weather": WEATHER, "get_time": TIME}[item.name]["parameters"]
    jsonschema.validate(json.loads(item.arguments), schema)


def test_tool_choice_required_gives_function_calls_of_the_tools(client):
    r = respond(client, ASK_WEATHER, 60, tools=[WEATHER, TIME], tool_choice="required")
    assert r.status == "completed" and r.output
    for item in r.output:
        _check_call(item, {"get_weather", "get_time"})
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required"


def test_named_function_is_called_and_its_arguments_stream(client):
    with client.responses.stream(model=MODEL, input=ASK_WEATHER, max_output_tokens=60,
                                 tools=[WEATHER, TIME],
                                 tool_choice={"type": "function", "name": "get_time"},
                                 **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [item] = final.output
    _check_call(item, {"get_time"})
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(e.delta for e in deltas) == deltas[-1].snapshot == item.arguments
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == item.arguments and done.item_id == item.id
    assert final.tool_choice.name == "get_time"


def test_function_call_and_its_output_as_input_read_as_the_chat_turns(client):
    args = json.dumps({"city": "Paris"})
    expected = chat(client, [
        {"role": "user", "content": ASK_WEATHER},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}], 8,
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in
                                                  ("name", "description", "parameters")}}])
    r = respond(client, [
        {"role": "user", "content": ASK_WEATHER},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}], 8,
        tools=[{k: v for k, v in WEATHER.items() if k != "strict"}])
    assert r.output_text == expected.choices[0].message.content
    assert r.usage.input_tokens == expected.usage.prompt_tokens


# --- errors ---

def test_previous_response_id_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_123")
    body = e.value.body
    assert body["param"] == "previous_response_id" and "whole conversation" in body["message"]


def test_an_image_part_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": "https://example.com/cat.png",
             "detail": "auto"}]}])
    assert e.value.body["param"] == "input[0].content[1].type"


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": "hi", "instructions": 3}, "instructions"),
    ({"input": "hi", "max_output_tokens": "8"}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "seed": 1.5}, "seed"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
     "tool_choice"),
    ({"input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice.type"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
    ({"input": "hi", "reasoning": "high"}, "reasoning"),
    ({"input": "hi", "metadata": {"k": 1}}, "metadata.k"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "background": True}, "background"),
], ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else v)
def test_unusable_input_is_a_400_before_any_stream(server, body, param):
    r = server.post("/v1/responses", {"model": MODEL, "stream": True, **body})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


def test_unknown_fields_are_ignored(client):
    r = client.responses.create(model=MODEL, input=PARIS, max_output_tokens=2, temperature=0,
                                store=False, metadata={"run": "1"}, user="u1",
                                extra_body={"no_such_field": 1, "truncation": "auto"})
    assert r.metadata == {"run": "1"} and r.user == "u1" and r.output_text


# --- the output builder, without a server: events the SDK's models accept ---

def _builder(**body) -> ResponseBuilder:
    req = parse_responses_request({"input": "hi", **body})
    return ResponseBuilder(new_response(req, "resp_test", "m", SamplingParams()))


def test_reasoning_then_text_make_two_items_and_valid_events():
    b = _builder()
    events = b.start()
    events += b.feed(Delta(reasoning="Think"))
    events += b.feed(Delta(reasoning="ing."))
    events += b.feed(Delta(content="Hi", finish_reason="stop"))
    events += b.finish({"input_tokens": 1, "input_tokens_details": {
        "cached_tokens": 0, "cache_write_tokens": 0}, "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 4})
    for e in events:
        EVENT.validate_python(e)
    final = Response.model_validate(events[-1]["response"])
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Thinking." and final.output_text == "Hi"
    assert [e["type"] for e in events][2:7] == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done"]


def test_calls_follow_text_as_their_own_items():
    b = _builder(tools=[WEATHER])
    events = b.start() + b.feed(Delta(content="Let me check."))
    events += b.feed(Delta(tool_calls=[ToolCallDelta(0, "", "call_a", "get_weather")]))
    events += b.feed(Delta(tool_calls=[ToolCallDelta(0, '{"city": ')]))
    events += b.feed(Delta(tool_calls=[ToolCallDelta(0, '"Paris"}'),
                                       ToolCallDelta(1, "{}", "call_b", "get_weather")],
                           finish_reason="tool_calls"))
    events += b.finish(None)
    for e in events:
        EVENT.validate_python(e)
    out = Response.model_validate(events[-1]["response"]).output
    assert [(o.type, o.status) for o in out] == [("message", "completed"),
                                                ("function_call", "completed"),
                                                ("function_call", "completed")]
    assert [(o.call_id, o.arguments) for o in out[1:]] == [("call_a", '{"city": "Paris"}'),
                                                          ("call_b", "{}")]


def test_a_failure_after_the_start_ends_with_error_and_response_failed():
    b = _builder()
    events = b.start() + b.feed(Delta(content="Hal"))
    events += b.fail("The engine aborted the request.")
    for e in events:
        EVENT.validate_python(e)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.output[0].status == "incomplete" and failed.output_text == "Hal"


def test_the_stream_turns_an_error_mid_reply_into_events():
    class Failing:  # a Generation whose engine aborts after the first delta
        request_id = "resp-test"

        async def deltas(self):
            yield Delta(content="Hal")
            raise RequestFailedError("resp-test", "The engine aborted the request.")

    async def run():
        failing = Failing()
        return [e async for e in reply_events([failing], ResponsesReply(_builder(), failing,
                                                                        8192))]

    events = asyncio.run(run())
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "error",
        "response.failed"]
    assert "The engine aborted the request." in events[-1]["response"]["error"]["message"]
