"""/v1/chat/completions' body as a checked, typed request: `parse_chat_request` returns a frozen
`ChatCompletionRequest` or raises InvalidRequestError naming the field (`param`). The other
chat dialects (Responses, Ollama's /api/chat) build the same type from their own shapes, with
the readers here where the shapes agree.

Fields kiln does not know are ignored without a log line; known fields of the wrong JSON type
are a 400 (api/protocol/fields.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kiln.api.protocol.fields import (
    array,
    bad,
    boolean,
    invalid_type,
    json_object,
    missing,
    require_object,
    string,
    unsupported,
)
from kiln.api.protocol.options import (
    include_usage,
    n_choices,
    request_options,
    sampling_fields,
    top_logprobs,
)
from kiln.runtime.engine.engine_request import RequestOptions
from kiln.runtime.sampling.grammar import GrammarSpec
from kiln.runtime.sampling.settings import SamplingFields
from kiln.runtime.text.tools import ToolCall, ToolChoice, ToolSpec

TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str | None  # text parts joined with "\n"; None: an assistant turn without text
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def to_template(self) -> dict:
        """The message as a chat template sees it (tool call arguments parsed, as vLLM does)."""
        msg: dict[str, Any] = {"role": self.role, "content": self.content}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}}
                for c in self.tool_calls]
        return msg


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    type: str  # "text" | "json_object" | "json_schema"
    schema: dict | None = None  # json_schema.schema
    name: str | None = None
    strict: bool | None = None
    param: str = field(default="response_format", compare=False)  # where the client set it

    def grammar(self) -> GrammarSpec | None:
        """What the reply must match; None for plain text."""
        if self.type == "json_object":
            return GrammarSpec("json_object", param=self.param)
        if self.type == "json_schema":
            return GrammarSpec.json_schema(self.schema or {}, param=self.param)
        return None


@dataclass(frozen=True, slots=True)
class ChatCompletionRequest:
    messages: tuple[ChatMessage, ...]
    sampling: SamplingFields
    options: RequestOptions = field(default_factory=RequestOptions)
    model: str | None = None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    n: int = 1
    user: str | None = None
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool | None = None  # read only to reject it with continuation
    continue_final_message: bool = False


def _json_or_text(arguments: str) -> Any:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


# --- messages ---

def content_text(v: object, param: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A string, or the text parts of an array of content parts joined with newlines; a part
    of another kind is a 400 (kiln reads text)."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise invalid_type(param, "a string or an array of content parts", v)
    texts = []
    for i, part in enumerate(v):
        p = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise invalid_type(p, "an object", part)
        kind = string(part, "type", f"{p}.type")
        if kind is None:
            raise missing(f"{p}.type")
        key = "refusal" if kind == "refusal" and "refusal" in kinds else "text"
        if kind not in kinds:
            raise unsupported(f"Unsupported content part type {kind!r} in '{p}': kiln reads "
                              "text parts only.", f"{p}.type")
        text = string(part, key, f"{p}.{key}")
        if text is None:
            raise missing(f"{p}.{key}")
        texts.append(text)
    return "\n".join(texts)


def read_tool_call(v: object, param: str) -> ToolCall:
    if not isinstance(v, dict):
        raise invalid_type(param, "an object", v)
    fn = json_object(v, "function", f"{param}.function")
    if fn is None:
        raise missing(f"{param}.function")
    name = string(fn, "name", f"{param}.function.name")
    if name is None:
        raise missing(f"{param}.function.name")
    args = fn.get("arguments")
    if isinstance(args, dict):
        args = json.dumps(args)
    elif args is None:
        args = "{}"
    elif not isinstance(args, str):
        raise invalid_type(f"{param}.function.arguments", "a string", args)
    return ToolCall(id=string(v, "id", f"{param}.id"), name=name, arguments=args)


def read_message(v: object, param: str) -> ChatMessage:
    if not isinstance(v, dict):
        raise invalid_type(param, "an object", v)
    role = string(v, "role", f"{param}.role")
    if not role:
        raise missing(f"{param}.role")
    if role == "developer":  # OpenAI's newer name for the system role; templates know system
        role = "system"
    content = None if v.get("content") is None else content_text(v["content"],
                                                                 f"{param}.content")
    if content is None and role != "assistant":
        raise missing(f"{param}.content")
    calls = array(v, "tool_calls", f"{param}.tool_calls") or []
    reasoning = v.get("reasoning_content", v.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise invalid_type(f"{param}.reasoning_content", "a string", reasoning)
    return ChatMessage(
        role=role, content=content, name=string(v, "name", f"{param}.name"),
        tool_calls=tuple(read_tool_call(c, f"{param}.tool_calls[{i}]")
                         for i, c in enumerate(calls)),
        tool_call_id=string(v, "tool_call_id", f"{param}.tool_call_id"),
        reasoning_content=reasoning,
    )


# --- tools, tool_choice, response_format ---

def checked_tools(tools: list[ToolSpec], name_param: str) -> tuple[ToolSpec, ...]:
    """Tool names as kiln can write them in a call, once each; name_param: where the i-th
    name sits in the client's body ("tools[{i}].function.name")."""
    seen = set()
    for i, t in enumerate(tools):
        param = name_param.format(i=i)
        if not TOOL_NAME.fullmatch(t.name):
            raise bad(f"Invalid '{param}': {t.name!r}. Names may use letters, digits, '_', "
                      "'-', '.' and ':', up to 64 characters.", param, "invalid_value")
        if t.name in seen:
            raise bad(f"Duplicate tool name {t.name!r} in 'tools'.", param, "invalid_value")
        seen.add(t.name)
    return tuple(tools)


def read_tools(v: list) -> tuple[ToolSpec, ...]:
    """OpenAI's chat tools (Ollama's are the same shape)."""
    tools = []
    for i, t in enumerate(v):
        param = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid_type(param, "an object", t)
        kind = string(t, "type", f"{param}.type")
        if kind not in (None, "function"):
            raise unsupported(f"Unsupported tool type {kind!r}: kiln calls functions only.",
                              f"{param}.type")
        fn = json_object(t, "function", f"{param}.function")
        if fn is None:
            raise missing(f"{param}.function")
        name = string(fn, "name", f"{param}.function.name")
        if not name:
            raise missing(f"{param}.function.name")
        tools.append(ToolSpec(
            name=name, description=string(fn, "description", f"{param}.function.description"),
            parameters=json_object(fn, "parameters", f"{param}.function.parameters") or {},
            strict=boolean(fn, "strict", f"{param}.function.strict")))
    return checked_tools(tools, "tools[{i}].function.name")


def checked_tool_choice(choice: ToolChoice, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    if choice.mode == "function" and choice.name not in {t.name for t in tools}:
        raise bad(f"Invalid 'tool_choice': no tool named {choice.name!r} in 'tools'.",
                  "tool_choice", "invalid_value")
    if choice.mode == "required" and not tools:
        raise bad("tool_choice 'required' needs at least one tool in 'tools'.",
                  "tool_choice", "invalid_value")
    return choice


def tool_choice_mode(v: str) -> ToolChoice:
    if v not in ("none", "auto", "required"):
        raise bad(f"Invalid 'tool_choice': {v!r}. Expected 'none', 'auto', 'required' or a "
                  "function.", "tool_choice", "invalid_value")
    return ToolChoice(mode=v)


def _tool_choice(v: object, tools: tuple[ToolSpec, ...]) -> ToolChoice | None:
    if v is None:
        return None
    if isinstance(v, str):
        return checked_tool_choice(tool_choice_mode(v), tools)
    if not isinstance(v, dict):
        raise invalid_type("tool_choice", "a string or an object", v)
    fn = json_object(v, "function", "tool_choice.function") or {}
    name = string(fn, "name", "tool_choice.function.name")
    if not name:
        raise missing("tool_choice.function.name")
    return checked_tool_choice(ToolChoice(mode="function", name=name), tools)


def read_response_format(v: object, param: str = "response_format") -> ResponseFormat | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid_type(param, "an object", v)
    kind = string(v, "type", f"{param}.type")
    if kind in ("text", "json_object"):
        return ResponseFormat(type=kind, param=param)
    if kind != "json_schema":
        raise bad(f"Invalid '{param}.type': {kind!r}. Expected 'text', 'json_object' or "
                  "'json_schema'.", f"{param}.type", "invalid_value")
    js = json_object(v, "json_schema", f"{param}.json_schema")
    if js is None:
        raise missing(f"{param}.json_schema")
    return ResponseFormat(type=kind, schema=json_object(js, "schema", f"{param}.json_schema."
                                                        "schema") or {},
                          name=string(js, "name", f"{param}.json_schema.name"),
                          strict=boolean(js, "strict", f"{param}.json_schema.strict"),
                          param=param)


# --- the request ---

def parse_chat_request(body: object) -> ChatCompletionRequest:
    """A /v1/chat/completions body, checked; raises InvalidRequestError."""
    body = require_object(body)
    cont = bool(boolean(body, "continue_final_message"))
    add_gen = boolean(body, "add_generation_prompt")
    raw_messages = array(body, "messages")
    if cont and add_gen:
        raise bad("continue_final_message and add_generation_prompt cannot both be true.",
                  "continue_final_message")
    if cont and not raw_messages:
        raise bad("continue_final_message is true but there are no messages to continue.",
                  "continue_final_message")
    if raw_messages is None:
        raise missing("messages")
    if not raw_messages:
        raise bad("'messages' must contain at least one message.", "messages", "empty_array")
    messages = tuple(read_message(m, f"messages[{i}]") for i, m in enumerate(raw_messages))
    if cont and messages[-1].role != "assistant":
        raise bad("continue_final_message is true but the last message is not the "
                  f"assistant's (it is {messages[-1].role!r}).", "continue_final_message")
    if cont and not (messages[-1].content or "").strip():
        raise bad("continue_final_message is true but the final assistant message has no "
                  "text to continue.", "continue_final_message")
    sampling = sampling_fields(body)
    options = request_options(body, logprobs=top_logprobs(body))
    tools = read_tools(array(body, "tools") or [])
    return ChatCompletionRequest(
        messages=messages, sampling=sampling, options=options, model=string(body, "model"),
        stream=bool(boolean(body, "stream")), include_usage=include_usage(body),
        n=n_choices(body), user=string(body, "user"), tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=boolean(body, "parallel_tool_calls"),
        response_format=read_response_format(body.get("response_format")),
        add_generation_prompt=add_gen, continue_final_message=cont,
    )
