"""A /v1/responses body (OpenAI's Responses API) read into the chat pipeline's request.

The Responses API is chat in another shape: `input` items become chat messages, its flat
function tools become chat tools, `text.format` the response format, `max_output_tokens` the
reply's limit. This module reads that shape, naming its fields in every 400
(`input[2].content[0].type`, `tools[0].name`, `text.format.schema`), and builds the chat
request directly; the sampling fields sit at the top level (extra_body in the SDK) and are read
as the chat route reads them.

kiln keeps no state between requests: whatever points at a stored response or conversation
(`previous_response_id`, `conversation`, `item_reference`, `prompt`, `background`) is a 400
that says to send the whole conversation instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.api.protocol.chat import (
    ChatCompletionRequest,
    ChatMessage,
    ResponseFormat,
    checked_tool_choice,
    checked_tools,
    content_text,
    tool_choice_mode,
)
from kiln.api.protocol.fields import (
    array,
    as_typed,
    bad,
    boolean,
    integer,
    invalid_type,
    json_object,
    json_type_name,
    required,
    string,
    unsupported,
)
from kiln.api.protocol.options import MAX_TOP_LOGPROBS, sampling_fields, stop
from kiln.runtime.engine.engine_request import RequestOptions
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.text.tools import ToolCall, ToolChoice, ToolSpec

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "refusal")
OUTPUT_PARTS = ("input_text", "refusal")  # a function_call_output's
LOGPROBS_INCLUDE = "message.output_text.logprobs"
STATELESS = ("kiln keeps no response state, so {what} cannot be used: send the whole "
             "conversation in 'input' instead.")


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A checked /v1/responses request: the chat request it runs as, and what the Response
    object repeats back of it (OpenAI's Response echoes the request's settings)."""

    chat: ChatCompletionRequest
    stream: bool
    instructions: str | None
    max_output_tokens: int | None
    tools: tuple[dict, ...]  # as Responses function tools
    tool_choice: str | dict
    text_format: dict
    metadata: dict
    store: bool

    @property
    def parallel_tool_calls(self) -> bool:
        return self.chat.parallel_tool_calls is not False


def _text(obj: dict, key: str, param: str, is_required: bool = False) -> str | None:
    v = string(obj, key, param)
    return required(v, param) if is_required else v


# --- input ---

class _Conversation:
    """Chat messages built item by item: an assistant's text and the calls that follow it are
    one assistant message; a reasoning item goes with the assistant turn after it."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.reasoning: list[str] = []

    def add(self, message: dict) -> None:
        if message["role"] == "assistant" and self.reasoning:
            message["reasoning_content"] = "\n".join(self.reasoning)
            self.reasoning = []
        self.messages.append(message)

    def add_call(self, call: ToolCall) -> None:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self.reasoning:
            last = {"role": "assistant", "content": None}
            self.add(last)
        last["tool_calls"] = last.get("tool_calls", ()) + (call,)


def _message(item: dict, param: str) -> dict:
    role = _text(item, "role", f"{param}.role", is_required=True)
    if role not in ROLES:
        raise bad(f"Invalid '{param}.role': {role!r}. Expected one of {', '.join(ROLES)}.",
                  f"{param}.role", "invalid_value")
    content = content_text(required(item.get("content"), f"{param}.content"),
                           f"{param}.content", TEXT_PARTS)
    return {"role": "system" if role == "developer" else role, "content": content}


def _function_call(item: dict, param: str) -> ToolCall:
    name = _text(item, "name", f"{param}.name", is_required=True)
    arguments = _text(item, "arguments", f"{param}.arguments") or "{}"
    call_id = _text(item, "call_id", f"{param}.call_id", is_required=True)
    return ToolCall(id=call_id, name=name, arguments=arguments)


def _function_call_output(item: dict, param: str) -> dict:
    output = content_text(required(item.get("output"), f"{param}.output"), f"{param}.output",
                          OUTPUT_PARTS)
    return {"role": "tool", "content": output,
            "tool_call_id": _text(item, "call_id", f"{param}.call_id")}


def _reasoning(item: dict, param: str) -> list[str]:
    """The reasoning text an earlier reply showed (its content, else its summary); an
    encrypted-only item has none for kiln to read."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = array(item, key, f"{param}.{key}") or []
        texts = [p["text"] for p in parts if isinstance(p, dict) and p.get("type") == kind
                 and isinstance(p.get("text"), str)]
        if texts:
            return texts
    return []


def _messages(body: dict) -> tuple[ChatMessage, ...]:
    raw = required(body.get("input"), "input")
    if isinstance(raw, str):
        items = [{"role": "user", "content": raw}]
    elif isinstance(raw, list):
        items = raw
    else:
        raise invalid_type("input", "a string or an array of input items", raw)
    if not items:
        raise bad("'input' must contain at least one item.", "input", "empty_array")
    conv = _Conversation()
    instructions = _text(body, "instructions", "instructions")
    if instructions is not None:
        conv.add({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_type(param, "an object", item)
        kind = _text(item, "type", f"{param}.type") or "message"
        if kind == "message":
            conv.add(_message(item, param))
        elif kind == "function_call":
            conv.add_call(_function_call(item, param))
        elif kind == "function_call_output":
            conv.add(_function_call_output(item, param))
        elif kind == "reasoning":
            conv.reasoning += _reasoning(item, param)
        elif kind == "item_reference":
            raise unsupported(STATELESS.format(what=f"an item_reference ('{param}')"),
                              f"{param}.type")
        else:
            raise unsupported(f"Unsupported input item type {kind!r} in '{param}': kiln reads "
                              "messages, function_call and function_call_output items.",
                              f"{param}.type")
    return tuple(ChatMessage(**m) for m in conv.messages)


# --- tools, tool_choice, text.format ---

def _tools(body: dict) -> tuple[list[dict], tuple[ToolSpec, ...]]:
    """(Responses tools as the Response echoes them, the chat request's tools)."""
    raw = array(body, "tools") or []
    echoed, specs = [], []
    for i, t in enumerate(raw):
        param = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid_type(param, "an object", t)
        kind = _text(t, "type", f"{param}.type", is_required=True)
        if kind != "function":
            raise unsupported(f"Unsupported tool type {kind!r} in '{param}': kiln calls "
                              "function tools only.", f"{param}.type")
        fn = {"name": _text(t, "name", f"{param}.name", is_required=True),
              "description": _text(t, "description", f"{param}.description"),
              "parameters": json_object(t, "parameters", f"{param}.parameters"),
              "strict": boolean(t, "strict", f"{param}.strict")}
        echoed.append({"type": "function", **fn})
        specs.append(ToolSpec(fn["name"], fn["description"], fn["parameters"] or {},
                              fn["strict"]))
    return echoed, checked_tools(specs, "tools[{i}].name")


def _tool_choice(body: dict, tools: tuple[ToolSpec, ...]
                 ) -> tuple[str | dict, ToolChoice | None]:
    """(tool_choice as the Response echoes it, the chat request's)."""
    v = body.get("tool_choice")
    if v is None:
        return "auto", None
    if isinstance(v, str):
        return v, checked_tool_choice(tool_choice_mode(v), tools)
    if not isinstance(v, dict):
        raise invalid_type("tool_choice", "a string or an object", v)
    kind = _text(v, "type", "tool_choice.type", is_required=True)
    if kind != "function":
        raise unsupported(f"Unsupported 'tool_choice.type' {kind!r}: kiln takes 'none', "
                          "'auto', 'required' or a function.", "tool_choice.type")
    name = _text(v, "name", "tool_choice.name", is_required=True)
    return {"type": "function", "name": name}, \
        checked_tool_choice(ToolChoice("function", name), tools)


def _text_format(body: dict) -> tuple[dict, ResponseFormat | None]:
    """(text.format as the Response echoes it, the chat request's response format)."""
    text = json_object(body, "text", "text") or {}
    fmt = json_object(text, "format", "text.format")
    if fmt is None:
        return {"type": "text"}, None
    kind = _text(fmt, "type", "text.format.type", is_required=True)
    if kind in ("text", "json_object"):
        return {"type": kind}, ResponseFormat(kind, param="text.format")
    if kind != "json_schema":
        raise bad(f"Invalid 'text.format.type': {kind!r}. Expected 'text', 'json_object' or "
                  "'json_schema'.", "text.format.type", "invalid_value")
    schema = required(json_object(fmt, "schema", "text.format.schema"), "text.format.schema")
    name = _text(fmt, "name", "text.format.name") or "response"
    strict = boolean(fmt, "strict", "text.format.strict")
    echoed = {"type": "json_schema", "name": name, "schema": schema, "strict": strict}
    description = _text(fmt, "description", "text.format.description")
    if description is not None:
        echoed["description"] = description
    return echoed, ResponseFormat("json_schema", schema, name, strict, param="text.format")


# --- the request ---

def _refuse_state(body: dict) -> None:
    for key in ("previous_response_id", "conversation", "prompt"):
        if body.get(key) is not None:
            raise unsupported(STATELESS.format(what=f"'{key}'"), key)
    if body.get("background"):
        raise unsupported("'background' is not supported: kiln keeps no response to fetch "
                          "later; send the request without it.", "background")


def _logprobs(body: dict) -> int | None:
    """Asked by `include` or by top_logprobs: the top-N alternatives per token."""
    include = array(body, "include") or []
    asked = LOGPROBS_INCLUDE in include or bool(body.get("top_logprobs"))
    top = integer(body, "top_logprobs") or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad(f"Invalid 'top_logprobs': {top}. Expected a value from 0 to "
                  f"{MAX_TOP_LOGPROBS}.", "top_logprobs", "invalid_value")
    return top if asked else None


def _max_output_tokens(body: dict) -> int | None:
    n = integer(body, "max_output_tokens")
    if n is not None and n < 1:
        raise bad(f"Invalid 'max_output_tokens': {n}. Expected a value >= 1.",
                  "max_output_tokens", "integer_below_min_value")
    return n


def parse_responses_request(body: object) -> ResponsesRequest:
    """A /v1/responses body, checked; raises InvalidRequestError naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    _refuse_state(body)
    messages = _messages(body)
    max_output = _max_output_tokens(body)
    tools, specs = _tools(body)
    tool_choice, choice = _tool_choice(body, specs)
    text_format, response_format = _text_format(body)
    reasoning = json_object(body, "reasoning", "reasoning") or {}
    effort = _text(reasoning, "effort", "reasoning.effort")
    sampling = sampling_fields(body, **({"reasoning_effort": effort} if effort is not None
                                       else {}))
    options = RequestOptions(max_tokens=max_output, stop=stop(body.get("stop")),
                             logprobs=_logprobs(body))
    metadata = json_object(body, "metadata", "metadata") or {}
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise InvalidRequestError(f"Invalid 'metadata.{key}': expected a string, but got "
                                      f"{json_type_name(value)} instead.",
                                      param=f"metadata.{key}", code="invalid_type")
    chat = ChatCompletionRequest(
        messages=messages, sampling=sampling, options=options, model=string(body, "model"),
        user=string(body, "user"), tools=specs, tool_choice=choice,
        parallel_tool_calls=boolean(body, "parallel_tool_calls"),
        response_format=response_format)
    store = as_typed(body.get("store"), bool, "a boolean", "store")
    return ResponsesRequest(
        chat=chat, stream=bool(boolean(body, "stream")),
        instructions=body.get("instructions"), max_output_tokens=max_output,
        tools=tuple(tools), tool_choice=tool_choice, text_format=text_format,
        metadata=metadata, store=store is not False)
