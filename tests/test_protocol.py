"""Request parsing: contract.md's 400 rows, and the bodies the official OpenAI SDK really sends."""

import json
import logging

import pytest

from kiln.api.errors import error_body, error_response, http_status
from kiln.api.protocol.chat import ChatMessage, ResponseFormat, parse_chat_request
from kiln.api.protocol.completions import parse_completion_request
from kiln.api.protocol.fields import load_json_body
from kiln.runtime.errors import (
    ContextLengthError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestFailedError,
)
from kiln.runtime.sampling.settings import SamplingFields
from kiln.runtime.text.tools import ToolCall, ToolChoice

USER = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return parse_chat_request({"model": "smollm2:135m", "messages": USER, **fields})


def completion(**fields):
    return parse_completion_request({"model": "smollm2:135m", "prompt": "Hi", **fields})


def rejects(parse, body, param):
    with pytest.raises(InvalidRequestError) as e:
        parse(body)
    err = e.value
    assert http_status(err) == 400 and err.param == param, (err.param, err.message)
    assert error_body(err)["error"]["type"] == "invalid_request_error"
    return err


# --- the official SDK's serialized requests -------------------------------------------------

class Captured(Exception):
    pass


def sdk_body(call):
    """The JSON body the openai SDK sends for `call(client)`, captured before any network."""
    openai = pytest.importorskip("openai")
    import httpx

    seen = {}

    def handler(request):
        seen["path"] = request.url.path
        seen["body"] = json.loads(request.content)
        raise Captured

    client = openai.OpenAI(base_url="http://kiln.test/v1", api_key="kiln", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    with pytest.raises(Captured):
        call(client)
    return seen["path"], seen["body"]


def test_sdk_chat_body_with_extra_body_fields_at_top_level():
    path, body = sdk_body(lambda c: c.chat.completions.create(
        model="smollm2:135m",
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "List ten animals, no repeats."}],
        temperature=0.7, top_p=0.8, presence_penalty=1.5, frequency_penalty=0, seed=42,
        max_tokens=64, stop=["\n\n", "END"], user="u-1",
        extra_body={"top_k": 20, "repetition_penalty": 1.0, "repeat_last_n": -1,
                    "min_p": 0.05, "think": False},
    ))
    assert path == "/v1/chat/completions" and body["top_k"] == 20  # extra_body is top-level
    r = parse_chat_request(body)
    assert r.sampling == SamplingFields(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05,
                                        presence_penalty=1.5, frequency_penalty=0,
                                        repetition_penalty=1.0, repeat_last_n=-1, seed=42,
                                        think=False)
    assert r.messages == (ChatMessage("system", "Be brief."),
                          ChatMessage("user", "List ten animals, no repeats."))
    assert (r.model, r.options.max_tokens, r.options.stop, r.user, r.stream) == (
        "smollm2:135m", 64, ("\n\n", "END"), "u-1", False)


def test_sdk_streaming_chat_with_usage_logprobs_and_continuation():
    _, body = sdk_body(lambda c: c.chat.completions.create(
        model="smollm2:135m", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Is Paris the capital of France?"},
                  {"role": "assistant", "content": "The answer is:"}],
        max_completion_tokens=1, logprobs=True, top_logprobs=5, n=1,
        reasoning_effort="low", extra_body={"continue_final_message": True},
    ))
    r = parse_chat_request(body)
    assert (r.stream, r.include_usage, r.options.logprobs, r.n) == (True, True, 5, 1)
    assert r.continue_final_message and r.options.max_tokens == 1
    assert r.sampling.reasoning_effort == "low" and r.messages[-1].role == "assistant"


def test_sdk_chat_with_tools_and_a_tool_turn():
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    ]
    _, body = sdk_body(lambda c: c.chat.completions.create(
        model="smollm2:135m", messages=messages, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False))
    r = parse_chat_request(body)
    assert r.tools[0].name == "get_weather" and r.tools[0].parameters["required"] == ["city"]
    assert r.tools[0].to_template() == tool
    assert r.tool_choice == ToolChoice("function", "get_weather")
    assert r.parallel_tool_calls is False
    assistant = r.messages[1]
    assert assistant.content is None
    assert assistant.tool_calls == (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)
    # Templates get parsed arguments, as vLLM gives them.
    assert assistant.to_template()["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert r.messages[2].tool_call_id == "call_1"


def test_sdk_chat_with_a_json_schema_response_format():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    _, body = sdk_body(lambda c: c.chat.completions.create(
        model="m", messages=USER,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "num", "schema": schema, "strict": True}}))
    assert parse_chat_request(body).response_format == ResponseFormat(
        "json_schema", schema, "num", True)


def test_sdk_chat_with_text_content_parts():
    _, body = sdk_body(lambda c: c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": [
            {"type": "text", "text": "First."}, {"type": "text", "text": "Second."}]}]))
    assert parse_chat_request(body).messages[0].content == "First.\nSecond."


def test_sdk_completion_bodies():
    path, body = sdk_body(lambda c: c.completions.create(
        model="smollm2:135m", prompt="Once upon a time", max_tokens=16, logprobs=3,
        echo=True, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"repeat_last_n": 0}))
    r = parse_completion_request(body)
    assert path == "/v1/completions"
    assert (r.prompt, r.options.max_tokens, r.options.logprobs, r.echo, r.stream,
            r.include_usage) == ("Once upon a time", 16, 3, True, True, True)
    assert r.sampling.temperature == 0 and r.sampling.repeat_last_n == 0
    _, body = sdk_body(lambda c: c.completions.create(model="m", prompt=[1, 2, 3]))
    assert parse_completion_request(body).prompt == (1, 2, 3)


# --- contract.md's validation rows ----------------------------------------------------------

@pytest.mark.parametrize("messages", [None, []], ids=["missing", "empty"])
def test_messages_missing_or_empty_is_a_400(messages):
    body = {"model": "m"} if messages is None else {"model": "m", "messages": messages}
    rejects(parse_chat_request, body, "messages")


def test_messages_of_the_wrong_type_is_a_400():
    rejects(parse_chat_request, {"messages": "hi"}, "messages")
    rejects(parse_chat_request, {"messages": ["hi"]}, "messages[0]")


def test_a_message_without_a_role_is_a_400():
    rejects(parse_chat_request, {"messages": [*USER, {"content": "x"}]}, "messages[1].role")
    rejects(parse_chat_request, {"messages": [{"role": 3, "content": "x"}]}, "messages[0].role")


def test_a_user_message_without_content_is_a_400():
    rejects(parse_chat_request, {"messages": [{"role": "user"}]}, "messages[0].content")


def test_a_non_text_content_part_is_a_400():
    part = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    rejects(parse_chat_request, {"messages": [{"role": "user", "content": [part]}]},
            "messages[0].content[0].type")


def test_prompt_missing_is_a_400():
    rejects(parse_completion_request, {"model": "m"}, "prompt")
    rejects(parse_completion_request, {"model": "m", "prompt": None}, "prompt")


@pytest.mark.parametrize("prompt,expected", [
    ("text", "text"), ("", ""), (["text"], "text"), ([5, 0, 7], (5, 0, 7)), ([[5, 7]], (5, 7)),
])
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompt == expected


@pytest.mark.parametrize("prompt", [[], [[]], [1, -2], [1, "a"], [True, 1], 5, {"text": "a"},
                                    ["a", 5], ["a", [1, -1]], ["a"] * 65])
def test_malformed_prompts_are_a_400(prompt):
    rejects(parse_completion_request, {"prompt": prompt}, "prompt")


def test_a_batch_of_prompts_is_several_prompts():
    assert completion(prompt=["a", "b"]).prompts == ("a", "b")
    assert completion(prompt=[[1], [2, 3], "c"]).prompts == ((1,), (2, 3), "c")
    assert completion(prompt=["a"] * 64).prompts == ("a",) * 64


@pytest.mark.parametrize("field,value", [
    ("temperature", "hot"), ("temperature", True), ("top_p", "1"), ("top_k", 2.5),
    ("min_p", [0]), ("presence_penalty", "0"), ("frequency_penalty", "x"),
    ("repetition_penalty", False), ("max_tokens", 1.5), ("max_tokens", "16"),
    ("max_tokens", True), ("max_completion_tokens", 2.5), ("stream", "yes"), ("stream", 1),
    ("stop", 5), ("stop", ["a", 1]), ("n", "1"), ("logprobs", "true"), ("top_logprobs", 1.5),
    ("model", 5), ("user", 5), ("tools", {}), ("response_format", "json"),
    ("tool_choice", 3), ("parallel_tool_calls", "no"), ("stream_options", True),
    ("think", "yes"), ("reasoning_effort", 1), ("add_generation_prompt", "yes"),
])
def test_a_known_field_of_the_wrong_type_is_a_400_naming_it(field, value):
    err = rejects(parse_chat_request, {"messages": USER, field: value}, field)
    assert err.message.startswith(f"Invalid type for '{field}'")


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 1.5), ("logprobs", True), ("logprobs", 1.5), ("echo", "yes"),
    ("temperature", "hot"), ("prompt", 3.0),
])
def test_a_known_completion_field_of_the_wrong_type_is_a_400(field, value):
    rejects(parse_completion_request, {"prompt": "Hi", field: value}, field)


def test_include_usage_of_the_wrong_type_names_the_nested_field():
    rejects(parse_chat_request, {"messages": USER, "stream_options": {"include_usage": "y"}},
            "stream_options.include_usage")


def test_ints_are_fine_for_numbers_and_integral_numbers_for_integers():
    r = chat(temperature=1, top_p=1, max_tokens=16.0, top_k=40.0, seed=7.0)
    assert (r.sampling.temperature, r.sampling.top_p, r.options.max_tokens) == (1, 1, 16)
    assert (r.sampling.top_k, r.sampling.seed) == (40, 7)
    assert isinstance(r.options.max_tokens, int) and isinstance(r.sampling.seed, int)


@pytest.mark.parametrize("seed", [True, 1.5, "42", 2**63, -(2**63) - 1, [1]])
def test_seed_not_a_signed_64_bit_integer_is_a_400(seed):
    rejects(parse_chat_request, {"messages": USER, "seed": seed}, "seed")
    rejects(parse_completion_request, {"prompt": "x", "seed": seed}, "seed")


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63 - 1])
def test_any_signed_64_bit_seed_parses(seed):
    assert chat(seed=seed).sampling.seed == seed


@pytest.mark.parametrize("n", ["64", 1.5, -2, True])
def test_repeat_last_n_not_an_integer_or_below_minus_one_is_a_400(n):
    rejects(parse_chat_request, {"messages": USER, "repeat_last_n": n}, "repeat_last_n")
    rejects(parse_completion_request, {"prompt": "x", "repeat_last_n": n}, "repeat_last_n")


def test_out_of_range_sampling_values_parse_they_are_the_stores_business():
    r = chat(temperature=-1, top_p=5, top_k=0, presence_penalty=-2, repetition_penalty=0)
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.top_k) == (-1, 5, 0)


def test_unknown_and_misspelt_fields_are_ignored_without_a_log_line(caplog):
    with caplog.at_level(logging.DEBUG):
        r = chat(temprature=0.1, options={"repeat_last_n": 2}, logit_bias={"1": 5},
                 metadata={"a": "b"}, store=True, service_tier="auto")
    assert r.sampling == SamplingFields() and caplog.records == []


def test_n_from_1_to_16():
    assert chat(n=1).n == 1 and chat().n == 1 and chat(n=16).n == 16
    assert completion(prompt="x", n=3).n == 3
    err = rejects(parse_chat_request, {"messages": USER, "n": 17}, "n")
    assert "1 to 16" in err.message
    rejects(parse_completion_request, {"prompt": "x", "n": 0}, "n")
    rejects(parse_chat_request, {"messages": USER, "n": -1}, "n")


def test_logit_bias_min_tokens_and_ignore_eos():
    r = chat(logit_bias={"7": -100, "3": 2.5, "12": 100}, min_tokens=4, ignore_eos=True)
    assert r.options.logit_bias == ((3, 2.5), (7, -100.0), (12, 100.0))
    assert (r.options.min_tokens, r.options.ignore_eos) == (4, True)
    plain = chat().options
    assert plain.logit_bias == () and plain.min_tokens == 0 and not plain.ignore_eos
    for bad in ({"x": 1}, {"-1": 1}, {"1.5": 1}, {"1": 100.5}, {"1": -101}):
        rejects(parse_chat_request, {"messages": USER, "logit_bias": bad}, "logit_bias")
    rejects(parse_chat_request, {"messages": USER, "logit_bias": {"1": "a"}}, "logit_bias.1")
    rejects(parse_chat_request, {"messages": USER, "min_tokens": -1}, "min_tokens")


def test_stop_token_ids_are_token_ids():
    assert chat(stop_token_ids=[7, 3, 7]).options.stop_token_ids == frozenset({3, 7})
    assert chat().options.stop_token_ids == frozenset()
    rejects(parse_chat_request, {"messages": USER, "stop_token_ids": [1, -2]}, "stop_token_ids")
    rejects(parse_chat_request, {"messages": USER, "stop_token_ids": 5}, "stop_token_ids")


def test_the_developer_role_is_the_system_role():
    r = chat(messages=[{"role": "developer", "content": "Be brief."}, *USER])
    assert [m.role for m in r.messages] == ["system", "user"]


def test_max_tokens_bounds_and_precedence():
    assert chat(max_tokens=10, max_completion_tokens=20).options.max_tokens == 20
    assert chat(max_tokens=10).options.max_tokens == 10 and chat().options.max_tokens is None
    rejects(parse_chat_request, {"messages": USER, "max_tokens": 0}, "max_tokens")
    rejects(parse_chat_request, {"messages": USER, "max_completion_tokens": -1},
            "max_completion_tokens")


def test_stop_as_a_string_or_a_list():
    assert chat(stop="END").options.stop == ("END",)
    assert chat(stop=["a", "", "b"]).options.stop == ("a", "b")
    assert chat(stop=None).options.stop == ()


def test_logprobs_bounds():
    assert chat(logprobs=True, top_logprobs=20).options.logprobs == 20
    assert chat(logprobs=False, top_logprobs=0).options.logprobs is None  # no logprobs
    rejects(parse_chat_request, {"messages": USER, "logprobs": True, "top_logprobs": 21},
            "top_logprobs")
    rejects(parse_chat_request, {"messages": USER, "top_logprobs": 2}, "top_logprobs")
    assert completion(logprobs=0).options.logprobs == 0
    assert completion(logprobs=5).options.logprobs == 5
    rejects(parse_completion_request, {"prompt": "x", "logprobs": 6}, "logprobs")
    rejects(parse_completion_request, {"prompt": "x", "logprobs": -1}, "logprobs")


def test_tool_choice_checks():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat(tools=tools, tool_choice="required").tool_choice == ToolChoice("required")
    assert chat(tool_choice="none").tool_choice == ToolChoice("none")
    rejects(parse_chat_request, {"messages": USER, "tool_choice": "required"}, "tool_choice")
    rejects(parse_chat_request, {"messages": USER, "tool_choice": "sometimes"}, "tool_choice")
    rejects(parse_chat_request, {"messages": USER, "tools": tools, "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice")
    rejects(parse_chat_request, {"messages": USER, "tools": [{"type": "function"}]},
            "tools[0].function")


def test_response_format_checks():
    assert chat(response_format={"type": "json_object"}).response_format == ResponseFormat(
        "json_object")
    rejects(parse_chat_request, {"messages": USER, "response_format": {"type": "xml"}},
            "response_format.type")
    rejects(parse_chat_request, {"messages": USER, "response_format": {"type": "json_schema"}},
            "response_format.json_schema")


# --- continue_final_message ---

CONTINUE = [*USER, {"role": "assistant", "content": "The answer is:"}]


def test_continue_final_message_parses():
    r = parse_chat_request({"messages": CONTINUE, "continue_final_message": True,
                            "add_generation_prompt": False})
    assert r.continue_final_message and r.add_generation_prompt is False


@pytest.mark.parametrize("value", [None, False])
def test_continue_final_message_false_or_null_is_the_default(value):
    r = parse_chat_request({"messages": CONTINUE, "continue_final_message": value,
                            "add_generation_prompt": True})
    assert r.continue_final_message is False


@pytest.mark.parametrize("value", ["true", 1, 0, [], {}])
def test_continue_final_message_not_a_boolean_or_null_is_a_400(value):
    rejects(parse_chat_request, {"messages": CONTINUE, "continue_final_message": value},
            "continue_final_message")


def test_continue_final_message_with_add_generation_prompt_true_is_a_400():
    rejects(parse_chat_request, {"messages": CONTINUE, "continue_final_message": True,
                                 "add_generation_prompt": True}, "continue_final_message")


def test_continue_final_message_when_the_last_message_is_not_the_assistants_is_a_400():
    rejects(parse_chat_request, {"messages": USER, "continue_final_message": True},
            "continue_final_message")


@pytest.mark.parametrize("messages", [None, []], ids=["missing", "empty"])
def test_continue_final_message_with_no_messages_is_a_400(messages):
    body = {"continue_final_message": True}
    if messages is not None:
        body["messages"] = messages
    rejects(parse_chat_request, body, "continue_final_message")


@pytest.mark.parametrize("content", [None, "", "  "])
def test_continue_final_message_with_no_text_to_continue_is_a_400(content):
    messages = [*USER, {"role": "assistant", "content": content}]
    rejects(parse_chat_request, {"messages": messages, "continue_final_message": True},
            "continue_final_message")


# --- bodies and error shapes ---

@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'"text"', b'{"temperature": NaN}',
                                 b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_is_a_400(raw):
    with pytest.raises(InvalidRequestError):
        load_json_body(raw)


def test_load_json_body_returns_the_object():
    assert load_json_body(b'{"messages": []}') == {"messages": []}


def test_error_bodies_have_openais_shape():
    status, body = error_response(InvalidRequestError("bad", param="temperature"), "r1")
    assert (status, body) == (400, {"error": {"message": "bad", "type": "invalid_request_error",
                                              "param": "temperature", "code": None}})
    status, body = error_response(ContextLengthError(num_prompt_tokens=9000, ctx_len=8192), "r")
    assert (status, body) == (400, {"error": {"message": "Max length reached!",
                                              "type": "model_error", "param": None,
                                              "code": 400}})
    status, body = error_response(ModelNotFoundError(), "r")
    assert (status, body["error"]["param"], body["error"]["code"]) == (404, "model",
                                                                        "model_not_found")
    assert error_response(RequestFailedError("req-9"), "r")[0] == 500


def test_an_unexpected_exception_is_a_500_quoting_the_request_id_and_logged(caplog):
    with caplog.at_level(logging.ERROR, logger="kiln"):
        status, body = error_response(RuntimeError("boom"), "req-42")
    assert status == 500 and "req-42" in body["error"]["message"]
    assert body["error"]["type"] == "server_error" and "boom" not in body["error"]["message"]
    assert any("req-42" in r.getMessage() and r.exc_info for r in caplog.records)
