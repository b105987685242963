"""runtime/text/tools.py, tool_plan.py and tool_parser.py: what tools / tool_choice /
response_format mean, the tool-call grammar with SmolLM2's real vocabulary, and tool calls
read back out of text, streamed or not."""

import json
import random

import pytest

from kiln.api.pipeline.chat import tool_plan
from kiln.api.protocol.chat import parse_chat_request
from kiln.api.routes.chat_completions import tool_call_delta_json
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.sampling.grammar import GrammarCompilerCache, GrammarState
from kiln.runtime.text.chat_template import ChatTemplate
from kiln.runtime.text.tokenizer import Tokenizer, gguf_reader
from kiln.runtime.text.tool_parser import ToolCallParser, parse_tool_calls
from kiln.runtime.text.tools import (
    HERMES,
    SMOLLM2,
    template_handles_tools,
    tool_format_for,
    tool_messages,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**fields):
    return parse_chat_request({"messages": USER, **fields})


@pytest.fixture(scope="module")
def reader(smollm2_gguf):
    return gguf_reader(smollm2_gguf)  # opened once for the tokenizer and the template


@pytest.fixture(scope="module")
def tok(reader):
    return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def grammars(tok):
    return GrammarCompilerCache(tok, vocab_size=49152)


def steps_through(state: GrammarState, tok, text: str) -> bool:
    """Accept `text` token by token, then a stop token; True if all of it is accepted."""
    ids = tok.encode(text, add_special_tokens=False) + [tok.encode("<|im_end|>")[0]]
    return all(state.accept(i) for i in ids) and state.is_terminated()


# --- the plan -------------------------------------------------------------------------------

def test_plan_for_each_tool_choice():
    auto = tool_plan(chat(tools=[WEATHER, TIME]), SMOLLM2)
    assert auto.choice.mode == "auto" and auto.grammar is None and auto.parse_calls
    assert auto.max_calls is None and [t.name for t in auto.prompt_tools] == ["get_weather",
                                                                             "get_time"]
    required = tool_plan(chat(tools=[WEATHER, TIME], tool_choice="required"), SMOLLM2)
    assert required.grammar.kind == "structural_tag" and required.grammar.param == "tools"
    assert required.parse_calls
    named = tool_plan(chat(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}}), SMOLLM2)
    assert named.max_calls == 1 and 'get_time' in named.grammar.text
    assert 'get_weather' not in named.grammar.text
    none = tool_plan(chat(tools=[WEATHER], tool_choice="none"), SMOLLM2)
    assert none.prompt_tools == () and none.grammar is None and none.parser() is None
    no_tools = tool_plan(chat(), SMOLLM2)
    assert no_tools.choice.mode == "none" and not no_tools.parse_calls
    single = tool_plan(chat(tools=[WEATHER], parallel_tool_calls=False), SMOLLM2)
    assert single.max_calls == 1


def test_plan_for_response_format():
    assert tool_plan(chat(response_format={"type": "text"}), HERMES).grammar is None
    assert tool_plan(chat(response_format={"type": "json_object"}), HERMES).grammar.kind == \
        "json_object"
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {}}}
    spec = tool_plan(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}}), HERMES).grammar
    assert spec.kind == "json_schema" and json.loads(spec.text) == schema
    assert list(json.loads(spec.text)["properties"]) == ["b", "a"]  # order kept
    # A forced call wins over response_format; with "auto" the format holds and no call parses.
    forced = tool_plan(chat(tools=[WEATHER], tool_choice="required",
                             response_format={"type": "json_object"}), HERMES)
    assert forced.grammar.kind == "structural_tag"
    auto = tool_plan(chat(tools=[WEATHER], response_format={"type": "json_object"}), HERMES)
    assert auto.grammar.kind == "json_object" and not auto.parse_calls


@pytest.mark.parametrize("tools,param", [
    ([{"type": "function", "function": {"name": "get weather"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": 'a"b'}}], "tools[0].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
])
def test_bad_tool_names_are_400s(tools, param):
    with pytest.raises(InvalidRequestError) as err:
        tool_plan(chat(tools=tools), HERMES)
    assert err.value.param == param


def test_protocol_already_rejects_the_rest():
    with pytest.raises(InvalidRequestError) as err:
        chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError) as err:
        chat(tools=[{"type": "function", "function": {"description": "no name"}}])
    assert err.value.param == "tools[0].function.name"
    with pytest.raises(InvalidRequestError) as err:
        chat(response_format={"type": "yaml"})
    assert err.value.param == "response_format.type"


def test_invalid_parameters_schema_is_a_400_on_tools(grammars):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    spec = tool_plan(chat(tools=[bad], tool_choice="required"), HERMES).grammar
    with pytest.raises(InvalidRequestError) as err:
        grammars.get(spec)
    assert err.value.param == "tools"


# --- the grammar ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [SMOLLM2, HERMES])
def test_named_function_grammar_takes_its_call_and_refuses_another(grammars, tok, fmt):
    spec = tool_plan(chat(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), fmt).grammar
    compiled = grammars.get(spec)
    call = fmt.render_calls([("get_weather", '{"city": "Paris", "days": 2}')])
    assert steps_through(GrammarState(compiled), tok, call)
    other = fmt.render_calls([("get_time", '{"tz": "UTC"}')])
    assert not GrammarState(compiled).matcher.accept_string(other)
    # Arguments must match the tool's schema: "city" is required.
    assert not GrammarState(compiled).matcher.accept_string(
        fmt.render_calls([("get_weather", '{"days": 2}')]))
    # One call only: after it, nothing but the stop token.
    twice = fmt.render_calls([("get_weather", '{"city": "A"}')] * 2)
    assert not GrammarState(compiled).matcher.accept_string(twice)


@pytest.mark.parametrize("fmt", [SMOLLM2, HERMES])
def test_required_grammar_takes_several_calls_of_any_tool_but_no_text(grammars, tok, fmt):
    compiled = grammars.get(tool_plan(chat(tools=[WEATHER, TIME], tool_choice="required"),
                                       fmt).grammar)
    calls = [("get_time", '{"tz": "CET"}'), ("get_weather", '{"city": "Oslo"}')]
    assert steps_through(GrammarState(compiled), tok, fmt.render_calls(calls))
    assert not GrammarState(compiled).matcher.accept_string("Sure")
    state = GrammarState(compiled)  # no call at all is not allowed either
    assert not state.accept(tok.encode("<|im_end|>")[0])


def test_required_without_parallel_calls_allows_one(grammars):
    compiled = grammars.get(tool_plan(chat(tools=[WEATHER, TIME], tool_choice="required",
                                            parallel_tool_calls=False), SMOLLM2).grammar)
    one = SMOLLM2.render_calls([("get_time", '{"tz": "CET"}')])
    two = SMOLLM2.render_calls([("get_time", '{"tz": "CET"}')] * 2)
    assert GrammarState(compiled).matcher.accept_string(one)
    assert not GrammarState(compiled).matcher.accept_string(two)


def test_tool_without_parameters_takes_an_object(grammars):
    bare = {"type": "function", "function": {"name": "ping"}}
    compiled = grammars.get(tool_plan(chat(tools=[bare], tool_choice="required"),
                                       HERMES).grammar)
    assert GrammarState(compiled).matcher.accept_string(HERMES.render_calls([("ping", "{}")]))
    assert not GrammarState(compiled).matcher.accept_string(
        HERMES.render_calls([("ping", "[]")]))


# --- parsing ----------------------------------------------------------------------------------

SMOL_REPLY = ('Let me check.\n<tool_call>[\n'
              '{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\"", '
              '"days": [1, {"x": "}]"}]}},\n'
              '{"arguments": {"tz": "UTC"}, "name": "get_time"}\n]</tool_call>\n\nDone.')
HERMES_REPLY = ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
                '\n</tool_call>')


def test_parse_calls_out_of_a_reply():
    content, calls = parse_tool_calls(SMOL_REPLY, SMOLLM2)
    assert content == "Let me check.\nDone."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": 'Paris "centre"', "days": [1, {"x": "}]"}]}
    assert json.loads(calls[1].arguments) == {"tz": "UTC"}
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    content, calls = parse_tool_calls(HERMES_REPLY, HERMES)
    assert content == ""
    # Arguments written as a JSON string come out as that string.
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"tz": "CET"}), ("get_weather", {"city": "Oslo"})]


FENCED = 'Here:\n```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```'


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_hermes_reads_a_fenced_json_call_as_llama_cpp_does(chunk):
    """Small Qwen models answer `auto` with a fenced block; it is a call only when it holds a
    call of a known tool, and any other fenced JSON stays content, byte for byte."""
    def run(text, names):
        p = ToolCallParser(HERMES, names)
        content = "".join(p.feed(text[i:i + chunk]).content for i in range(0, len(text), chunk))
        return content + p.finish().content, p.tool_calls

    content, calls = run(FENCED, {"get_weather"})
    assert content == "Here:\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    for other, names in ((FENCED, {"get_time"}),
                         ('```json\n{"a": [1, 2]}\n```\nok', {"get_weather"}),
                         ("```json\n{\"name\": \"get_weather\"", {"get_weather"})):
        assert run(other, names) == (other, [])
    assert parse_tool_calls(FENCED, SMOLLM2, {"get_weather"}) == (FENCED, [])  # not SmolLM2's


def test_rendered_calls_parse_back(tok):
    calls = [("get_weather", '{"city": "Zürich"}'), ("get_time", '{"tz": "UTC"}')]
    for fmt in (SMOLLM2, HERMES):
        content, parsed = parse_tool_calls(fmt.render_calls(calls), fmt)
        assert content == "" and [(c.name, c.arguments) for c in parsed] == calls


def test_text_that_is_not_a_call_stays_content():
    for text in ("a <tool_call> not json </tool_call> b", "x <tool_call>[]</tool_call>",
                 "unfinished <tool_call>\n{\"name\": \"f\", \"argu", "ends with <tool_",
                 "<tool_call>\n{\"name\": \"unknown\", \"arguments\": {}}\n</tool_call>"):
        assert parse_tool_calls(text, HERMES, tool_names={"f"}) == (text, []), text


def test_max_calls_keeps_the_first():
    _, calls = parse_tool_calls(HERMES_REPLY, HERMES, max_calls=1)
    assert [c.name for c in calls] == ["get_time"]


def stream(text: str, cuts: list[int], fmt, **kw):
    """Feed `text` cut at `cuts`; returns (content, [(name, arguments)], the deltas)."""
    parser = ToolCallParser(fmt, **kw)
    bounds = [0, *sorted(cuts), len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    deltas.append(parser.finish())
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for t in d.tool_calls:
            j = tool_call_delta_json(t)
            if t.index not in calls:  # the first delta of a call names it
                assert j["id"].startswith("call_") and j["type"] == "function", j
                calls[t.index] = {"name": j["function"]["name"], "arguments": ""}
            else:
                assert "id" not in j and "name" not in j["function"], j
            calls[t.index]["arguments"] += j["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], deltas


@pytest.mark.parametrize("fmt,text", [(SMOLLM2, SMOL_REPLY), (HERMES, HERMES_REPLY),
                                      (HERMES, "plain <tool_call> junk </tool_call> <tool_")])
def test_streaming_gives_the_same_calls_wherever_the_text_is_cut(fmt, text):
    whole_content, whole = parse_tool_calls(text, fmt)
    expected = [(c.name, c.arguments) for c in whole]
    for cut in range(1, len(text)):  # every single cut
        assert stream(text, [cut], fmt)[:2] == (whole_content, expected), cut
    rng = random.Random(0)
    for _ in range(50):  # and many small pieces
        cuts = rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(2, 40)))
        assert stream(text, cuts, fmt)[:2] == (whole_content, expected), cuts
    content, calls, _ = stream(text, list(range(1, len(text))), fmt)  # one char at a time
    assert (content, calls) == (whole_content, expected)
    for _, args in calls:
        json.loads(args)


def test_arguments_stream_before_the_call_closes():
    text = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
    cut = text.index("Paris")
    parser = ToolCallParser(HERMES)
    first = parser.feed(text[:cut])
    assert [(t.index, t.name, t.arguments) for t in first.tool_calls] == \
        [(0, "get_time", '{"tz": "Europe/')]
    rest = parser.feed(text[cut:])
    assert [tool_call_delta_json(t) for t in rest.tool_calls] == \
        [{"index": 0, "function": {"arguments": 'Paris"}'}}]
    assert first.content == rest.content == ""


# --- the prompt ---------------------------------------------------------------------------------

def test_smollm2_template_ignores_tools_so_kiln_describes_them(reader):
    template = ChatTemplate.from_gguf(reader)
    assert not template_handles_tools(template.template_str)
    assert template_handles_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert tool_format_for("smollm2:135m") is SMOLLM2
    assert tool_format_for("/models/SmolLM2-360M.gguf") is SMOLLM2
    assert tool_format_for("gemma3:270m") is HERMES
    req = parse_chat_request({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ], "tools": [WEATHER]})
    plan = tool_plan(req, SMOLLM2)
    messages = tool_messages([m.to_template() for m in req.messages], plan.prompt_tools,
                             SMOLLM2)
    prompt = template.render(messages, add_generation_prompt=True)
    assert "named SmolLM" not in prompt  # our system message replaces the default one
    assert prompt.startswith("<|im_start|>system\nYou are an expert in composing functions")
    assert '<tools>[{"type": "function", "function": {"name": "get_weather"' in prompt
    assert ('<|im_start|>assistant\n<tool_call>[\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n]</tool_call><|im_end|>') in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tool_prompt_joins_an_existing_system_message():
    messages = tool_messages([{"role": "system", "content": "Be brief."}, *USER],
                             tool_plan(chat(tools=[WEATHER]), HERMES).prompt_tools, HERMES)
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '{"type": "function", "function": {"name": "get_weather"' in messages[0]["content"]
    assert messages[1:] == USER
