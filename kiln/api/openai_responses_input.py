"""A /v1/responses body (OpenAI's Responses API) read into the chat pipeline's request.

The Responses API is chat in another shape: `input` items become chat messages, its flat
function tools become chat tools, `text.format` becomes `response_format`,
`max_output_tokens` becomes `max_completion_tokens`. This module checks what only the
Responses shape has, naming its fields (`input[2].content[0].type`, `text.format.schema`),
then builds a /v1 chat body and hands it to `parse_chat_request`, so the sampling fields,
the sticky settings and every other check are the chat route's, word for word.

kiln keeps no state between requests: whatever points at a stored response or conversation
(`previous_response_id`, `conversation`, `item_reference`, `prompt`, `background`) is a 400
that says to send the whole conversation instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.api.json_fields import invalid_type, json_type_name, missing
from kiln.api.protocol import ChatCompletionRequest, parse_chat_request
from kiln.runtime.errors import InvalidRequestError

# Sent at the top level (extra_body in the SDK) and read as the chat route reads them.
CHAT_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "repeat_last_n", "seed", "think",
               "reasoning_effort", "stop", "parallel_tool_calls", "user", "top_logprobs")
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
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


# --- JSON readers that name the Responses field ---

def _get(obj: dict, key: str, kind: type | tuple, expected: str, param: str):
    v = obj.get(key)
    if v is not None and (not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool)):
        raise invalid_type(param, expected, v)
    return v


def _text(obj: dict, key: str, param: str, required: bool = False) -> str | None:
    v = _get(obj, key, str, "a string", param)
    if v is None and required:
        raise missing(param)
    return v


def _unsupported(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="unsupported_value")


# --- input ---

def _parts_text(content: object, param: str, parts: tuple[str, ...] = TEXT_PARTS) -> str:
    """A string, or the text of a list of content parts joined with newlines (as the chat
    route joins its text parts); anything but text is a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_type(param, "a string or an array of content parts", content)
    texts = []
    for i, part in enumerate(content):
        p = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise invalid_type(p, "an object", part)
        kind = _text(part, "type", f"{p}.type", required=True)
        if kind == "refusal":  # an assistant turn that refused: its words are its text
            texts.append(_text(part, "refusal", f"{p}.refusal", required=True))
        elif kind in parts:
            texts.append(_text(part, "text", f"{p}.text", required=True))
        else:
            raise _unsupported(f"Unsupported content part type {kind!r} in '{p}': kiln reads "
                               "text only.", f"{p}.type")
    return "\n".join(texts)


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

    def add_call(self, call: dict) -> None:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self.reasoning:
            last = {"role": "assistant", "content": None}
            self.add(last)
        last.setdefault("tool_calls", []).append(call)


def _message(item: dict, param: str) -> dict:
    role = _text(item, "role", f"{param}.role", required=True)
    if role not in ROLES:
        raise InvalidRequestError(f"Invalid '{param}.role': {role!r}. Expected one of "
                                  f"{', '.join(ROLES)}.", param=f"{param}.role",
                                  code="invalid_value")
    if item.get("content") is None:
        raise missing(f"{param}.content")
    content = _parts_text(item["content"], f"{param}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def _function_call(item: dict, param: str) -> dict:
    name = _text(item, "name", f"{param}.name", required=True)
    arguments = _text(item, "arguments", f"{param}.arguments") or "{}"
    call_id = _text(item, "call_id", f"{param}.call_id", required=True)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _function_call_output(item: dict, param: str) -> dict:
    if item.get("output") is None:
        raise missing(f"{param}.output")
    output = _parts_text(item["output"], f"{param}.output", ("input_text",))
    message = {"role": "tool", "content": output}
    call_id = _text(item, "call_id", f"{param}.call_id")
    if call_id is not None:
        message["tool_call_id"] = call_id
    return message


def _reasoning(item: dict, param: str) -> list[str]:
    """The reasoning text an earlier reply showed (its content, else its summary); an
    encrypted-only item has none for kiln to read."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = _get(item, key, list, "an array", f"{param}.{key}") or []
        texts = [p["text"] for p in parts if isinstance(p, dict) and p.get("type") == kind
                 and isinstance(p.get("text"), str)]
        if texts:
            return texts
    return []


def _messages(body: dict) -> list[dict]:
    raw = body.get("input")
    if raw is None:
        raise missing("input")
    if isinstance(raw, str):
        items = [{"role": "user", "content": raw}]
    elif isinstance(raw, list):
        items = raw
    else:
        raise invalid_type("input", "a string or an array of input items", raw)
    if not items:
        raise InvalidRequestError("'input' must contain at least one item.", param="input",
                                  code="empty_array")
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
            raise _unsupported(STATELESS.format(what=f"an item_reference ('{param}')"),
                               f"{param}.type")
        else:
            raise _unsupported(f"Unsupported input item type {kind!r} in '{param}': kiln reads "
                               "messages, function_call and function_call_output items.",
                               f"{param}.type")
    return conv.messages


# --- tools, tool_choice, text.format ---

def _tools(body: dict) -> tuple[list[dict], list[dict]]:
    """(Responses tools as the Response echoes them, chat tools)."""
    raw = _get(body, "tools", list, "an array", "tools") or []
    echoed, chat = [], []
    for i, t in enumerate(raw):
        param = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid_type(param, "an object", t)
        kind = _text(t, "type", f"{param}.type", required=True)
        if kind != "function":
            raise _unsupported(f"Unsupported tool type {kind!r} in '{param}': kiln calls "
                               "function tools only.", f"{param}.type")
        fn = {"name": _text(t, "name", f"{param}.name", required=True),
              "description": _text(t, "description", f"{param}.description"),
              "parameters": _get(t, "parameters", dict, "an object", f"{param}.parameters"),
              "strict": _get(t, "strict", bool, "a boolean", f"{param}.strict")}
        echoed.append({"type": "function", **fn})
        chat.append({"type": "function",
                     "function": {k: v for k, v in fn.items() if v is not None}})
    return echoed, chat


def _tool_choice(body: dict) -> tuple[str | dict, str | dict | None]:
    """(tool_choice as the Response echoes it, the chat route's tool_choice)."""
    v = body.get("tool_choice")
    if v is None:
        return "auto", None
    if isinstance(v, str):
        return v, v  # the chat route checks the value
    if not isinstance(v, dict):
        raise invalid_type("tool_choice", "a string or an object", v)
    kind = _text(v, "type", "tool_choice.type", required=True)
    if kind != "function":
        raise _unsupported(f"Unsupported 'tool_choice.type' {kind!r}: kiln takes 'none', "
                           "'auto', 'required' or a function.", "tool_choice.type")
    name = _text(v, "name", "tool_choice.name", required=True)
    return {"type": "function", "name": name}, {"type": "function", "function": {"name": name}}


def _text_format(body: dict) -> tuple[dict, dict | None]:
    """(text.format as the Response echoes it, the chat route's response_format)."""
    text = _get(body, "text", dict, "an object", "text") or {}
    fmt = _get(text, "format", dict, "an object", "text.format")
    if fmt is None:
        return {"type": "text"}, None
    kind = _text(fmt, "type", "text.format.type", required=True)
    if kind in ("text", "json_object"):
        return {"type": kind}, {"type": kind}
    if kind != "json_schema":
        raise InvalidRequestError(f"Invalid 'text.format.type': {kind!r}. Expected 'text', "
                                  "'json_object' or 'json_schema'.", param="text.format.type",
                                  code="invalid_value")
    schema = _get(fmt, "schema", dict, "an object", "text.format.schema")
    if schema is None:
        raise missing("text.format.schema")
    name = _text(fmt, "name", "text.format.name") or "response"
    strict = _get(fmt, "strict", bool, "a boolean", "text.format.strict")
    echoed = {"type": "json_schema", "name": name, "schema": schema, "strict": strict}
    description = _text(fmt, "description", "text.format.description")
    if description is not None:
        echoed["description"] = description
    return echoed, {"type": "json_schema",
                    "json_schema": {"name": name, "schema": schema, "strict": strict}}


# --- the request ---

def _refuse_state(body: dict) -> None:
    for key in ("previous_response_id", "conversation", "prompt"):
        if body.get(key) is not None:
            raise _unsupported(STATELESS.format(what=f"'{key}'"), key)
    if body.get("background"):
        raise _unsupported("'background' is not supported: kiln keeps no response to fetch "
                           "later; send the request without it.", "background")


def parse_responses_request(body: object) -> ResponsesRequest:
    """A /v1/responses body, checked; raises InvalidRequestError naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    _refuse_state(body)
    chat: dict[str, Any] = {k: body[k] for k in CHAT_FIELDS if k in body}
    chat["messages"] = _messages(body)
    max_output = _get(body, "max_output_tokens", (int, float), "an integer",
                      "max_output_tokens")
    if max_output is not None:
        if isinstance(max_output, float) and not max_output.is_integer():
            raise invalid_type("max_output_tokens", "an integer", max_output)
        max_output = int(max_output)
        if max_output < 1:
            raise InvalidRequestError(f"Invalid 'max_output_tokens': {max_output}. Expected a "
                                      "value >= 1.", param="max_output_tokens",
                                      code="integer_below_min_value")
        chat["max_completion_tokens"] = max_output
    tools, chat["tools"] = _tools(body)
    tool_choice, chat["tool_choice"] = _tool_choice(body)
    text_format, chat["response_format"] = _text_format(body)
    reasoning = _get(body, "reasoning", dict, "an object", "reasoning") or {}
    effort = _text(reasoning, "effort", "reasoning.effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    include = _get(body, "include", list, "an array", "include") or []
    if LOGPROBS_INCLUDE in include or body.get("top_logprobs"):
        chat["logprobs"] = True
    metadata = _get(body, "metadata", dict, "an object", "metadata") or {}
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise InvalidRequestError(f"Invalid 'metadata.{key}': expected a string, but got "
                                      f"{json_type_name(value)} instead.",
                                      param=f"metadata.{key}", code="invalid_type")
    stream = _get(body, "stream", bool, "a boolean", "stream")
    store = _get(body, "store", bool, "a boolean", "store")
    return ResponsesRequest(
        chat=parse_chat_request(chat), stream=bool(stream),
        instructions=body.get("instructions"), max_output_tokens=max_output,
        tools=tuple(tools), tool_choice=tool_choice, text_format=text_format,
        metadata=metadata, store=store is not False)
