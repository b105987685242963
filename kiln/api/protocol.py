"""Parse a request body into a typed request, with every check contract.md lists.

`parse_chat_request` / `parse_completion_request` take the decoded JSON body and either
return a frozen request or raise `InvalidRequestError` naming the field (`param`). Everything
here is decided before a stream starts. Fields kiln does not know are ignored without a log
line; known fields of the wrong JSON type are a 400 (a bool is not a number; an integer is
fine for a number; an integral number such as 2.0 is fine for an integer).

The sampling fields (and think, reasoning_effort, seed) go into `SamplingFields`, which checks
their types; ranges are the sticky store's business (runtime/sampling/settings.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kiln.api.json_fields import (
    array,
    bad,
    boolean,
    integer,
    invalid_type,
    json_object,
    missing,
    number,
    require_object,
    string,
)
from kiln.runtime.sampling.settings import SamplingFields

MAX_TOP_LOGPROBS = 20  # chat
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' integer logprobs
MAX_N = 16  # choices per request (they share the prompt's prefill)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value
MAX_PROMPTS = 64  # prompts in one /v1/completions request


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str | None
    name: str
    arguments: str  # JSON text, as OpenAI sends it


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
class ToolSpec:
    name: str
    description: str | None
    parameters: dict  # JSON schema of the arguments; {} when not sent
    strict: bool | None = None

    def to_template(self) -> dict:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "function"
    name: str | None = None  # mode "function": the tool that must be called


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    type: str  # "text" | "json_object" | "json_schema"
    schema: dict | None = None  # json_schema.schema
    name: str | None = None
    strict: bool | None = None


@dataclass(frozen=True, slots=True)
class ChatCompletionRequest:
    messages: tuple[ChatMessage, ...]
    sampling: SamplingFields
    model: str | None = None
    max_tokens: int | None = None  # max_completion_tokens, else max_tokens
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    user: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique
    min_tokens: int = 0
    ignore_eos: bool = False
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool | None = None  # read only to reject it with continuation
    continue_final_message: bool = False


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompts: tuple[str | tuple[int, ...], ...]  # each text, or token ids; one choice set each
    sampling: SamplingFields
    model: str | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # how many top alternatives per token; None = none
    echo: bool = False
    n: int = 1
    user: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False

    @property
    def prompt(self) -> str | tuple[int, ...]:
        """The first prompt (most requests send one)."""
        return self.prompts[0]


def _json_or_text(arguments: str) -> Any:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


# --- fields both endpoints share ---

def _sampling(body: dict) -> SamplingFields:
    return SamplingFields(
        temperature=number(body, "temperature"), top_p=number(body, "top_p"),
        top_k=integer(body, "top_k"), min_p=number(body, "min_p"),
        presence_penalty=number(body, "presence_penalty"),
        frequency_penalty=number(body, "frequency_penalty"),
        repetition_penalty=number(body, "repetition_penalty"),
        repeat_last_n=integer(body, "repeat_last_n"), seed=integer(body, "seed"),
        think=boolean(body, "think"), reasoning_effort=string(body, "reasoning_effort"),
    )


def _max_tokens(body: dict) -> int | None:
    values = {key: integer(body, key) for key in ("max_completion_tokens", "max_tokens")}
    for key, v in values.items():
        if v is not None and v < 1:
            raise bad(f"Invalid '{key}': {v}. Expected a value >= 1.", key,
                       "integer_below_min_value")
    # max_completion_tokens replaces the deprecated max_tokens (vLLM reads them this way).
    if values["max_completion_tokens"] is not None:
        return values["max_completion_tokens"]
    return values["max_tokens"]


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,) if v else ()
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(s for s in v if s)
    raise invalid_type("stop", "a string or an array of strings", v)


def _n(body: dict) -> int:
    n = integer(body, "n")
    if n is not None and not 1 <= n <= MAX_N:
        raise bad(f"Invalid 'n': {n}. Expected a value from 1 to {MAX_N}.", "n",
                   "invalid_value")
    return n or 1


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """{"token id": bias}: ids as OpenAI sends them (JSON keys, so strings), biases in
    [-100, 100]. Ids beyond the vocabulary are the engine's to reject (it knows the size)."""
    v = json_object(body, "logit_bias")
    if not v:
        return ()
    out = {}
    for key, bias in v.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0 or str(token) != key.strip().lstrip("+"):
            raise bad(f"Invalid 'logit_bias': {key!r} is not a token id.", "logit_bias",
                       "invalid_value")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise invalid_type(f"logit_bias.{key}", "a number", bias)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad(f"Invalid 'logit_bias' value for token {token}: {bias}. Expected a "
                       f"value from -{MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}.", "logit_bias",
                       "invalid_value")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _min_tokens(body: dict) -> int:
    v = integer(body, "min_tokens")
    if v is not None and v < 0:
        raise bad(f"Invalid 'min_tokens': {v}. Expected a value >= 0.", "min_tokens",
                   "integer_below_min_value")
    return v or 0


def _common(body: dict) -> dict[str, Any]:
    stream_options = json_object(body, "stream_options") or {}
    return dict(
        sampling=_sampling(body), model=string(body, "model"), max_tokens=_max_tokens(body),
        stop=_stop(body), stream=bool(boolean(body, "stream")),
        include_usage=bool(boolean(stream_options, "include_usage",
                                    "stream_options.include_usage")),
        n=_n(body), user=string(body, "user"), logit_bias=_logit_bias(body),
        min_tokens=_min_tokens(body), ignore_eos=bool(boolean(body, "ignore_eos")),
    )


# --- chat ---

def _content(v: object, param: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise invalid_type(param, "a string or an array of content parts", v)
    texts = []
    for i, part in enumerate(v):
        p = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise invalid_type(p, "an object", part)
        kind = string(part, "type", f"{p}.type")
        if kind != "text":
            raise bad(f"Unsupported content part type {kind!r} in '{p}': kiln reads text "
                       "parts only.", f"{p}.type", "unsupported_value")
        text = string(part, "text", f"{p}.text")
        if text is None:
            raise missing(f"{p}.text")
        texts.append(text)
    return "\n".join(texts)


def _tool_call(v: object, param: str) -> ToolCall:
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


def _message(v: object, param: str) -> ChatMessage:
    if not isinstance(v, dict):
        raise invalid_type(param, "an object", v)
    role = string(v, "role", f"{param}.role")
    if not role:
        raise missing(f"{param}.role")
    if role == "developer":  # OpenAI's newer name for the system role; templates know system
        role = "system"
    content = _content(v.get("content"), f"{param}.content")
    if content is None and role != "assistant":
        raise missing(f"{param}.content")
    calls = array(v, "tool_calls", f"{param}.tool_calls") or []
    reasoning = v.get("reasoning_content", v.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise invalid_type(f"{param}.reasoning_content", "a string", reasoning)
    return ChatMessage(
        role=role, content=content, name=string(v, "name", f"{param}.name"),
        tool_calls=tuple(_tool_call(c, f"{param}.tool_calls[{i}]") for i, c in enumerate(calls)),
        tool_call_id=string(v, "tool_call_id", f"{param}.tool_call_id"),
        reasoning_content=reasoning,
    )


def _tool(v: object, param: str) -> ToolSpec:
    if not isinstance(v, dict):
        raise invalid_type(param, "an object", v)
    kind = string(v, "type", f"{param}.type")
    if kind not in (None, "function"):
        raise bad(f"Unsupported tool type {kind!r}: kiln calls functions only.",
                   f"{param}.type", "unsupported_value")
    fn = json_object(v, "function", f"{param}.function")
    if fn is None:
        raise missing(f"{param}.function")
    name = string(fn, "name", f"{param}.function.name")
    if not name:
        raise missing(f"{param}.function.name")
    return ToolSpec(name=name, description=string(fn, "description", f"{param}.function."
                                                   "description"),
                    parameters=json_object(fn, "parameters", f"{param}.function.parameters") or {},
                    strict=boolean(fn, "strict", f"{param}.function.strict"))


def _tool_choice(v: object, tools: tuple[ToolSpec, ...]) -> ToolChoice | None:
    if v is None:
        return None
    if isinstance(v, str):
        if v not in ("none", "auto", "required"):
            raise bad(f"Invalid 'tool_choice': {v!r}. Expected 'none', 'auto', 'required' "
                       "or a function.", "tool_choice", "invalid_value")
        choice = ToolChoice(mode=v)
    elif isinstance(v, dict):
        fn = json_object(v, "function", "tool_choice.function") or {}
        name = string(fn, "name", "tool_choice.function.name")
        if not name:
            raise missing("tool_choice.function.name")
        if name not in {t.name for t in tools}:
            raise bad(f"Invalid 'tool_choice': no tool named {name!r} in 'tools'.",
                       "tool_choice", "invalid_value")
        choice = ToolChoice(mode="function", name=name)
    else:
        raise invalid_type("tool_choice", "a string or an object", v)
    if choice.mode == "required" and not tools:
        raise bad("tool_choice 'required' needs at least one tool in 'tools'.",
                   "tool_choice", "invalid_value")
    return choice


def _response_format(v: object) -> ResponseFormat | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid_type("response_format", "an object", v)
    kind = string(v, "type", "response_format.type")
    if kind in ("text", "json_object"):
        return ResponseFormat(type=kind)
    if kind != "json_schema":
        raise bad(f"Invalid 'response_format.type': {kind!r}. Expected 'text', "
                   "'json_object' or 'json_schema'.", "response_format.type", "invalid_value")
    js = json_object(v, "json_schema", "response_format.json_schema")
    if js is None:
        raise missing("response_format.json_schema")
    return ResponseFormat(type=kind, schema=json_object(js, "schema", "response_format.json_schema."
                                                    "schema") or {},
                          name=string(js, "name", "response_format.json_schema.name"),
                          strict=boolean(js, "strict", "response_format.json_schema.strict"))


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
    messages = tuple(_message(m, f"messages[{i}]") for i, m in enumerate(raw_messages))
    if cont and messages[-1].role != "assistant":
        raise bad("continue_final_message is true but the last message is not the "
                   f"assistant's (it is {messages[-1].role!r}).", "continue_final_message")
    if cont and not (messages[-1].content or "").strip():
        raise bad("continue_final_message is true but the final assistant message has no "
                   "text to continue.", "continue_final_message")

    logprobs = bool(boolean(body, "logprobs"))
    top = integer(body, "top_logprobs") or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad(f"Invalid 'top_logprobs': {top}. Expected a value from 0 to "
                   f"{MAX_TOP_LOGPROBS}.", "top_logprobs", "invalid_value")
    if top and not logprobs:
        raise bad("top_logprobs needs logprobs: true.", "top_logprobs", "invalid_value")
    raw_tools = array(body, "tools") or []
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw_tools))
    return ChatCompletionRequest(
        messages=messages, **_common(body), logprobs=logprobs, top_logprobs=top,
        tools=tools, tool_choice=_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=boolean(body, "parallel_tool_calls"),
        response_format=_response_format(body.get("response_format")),
        add_generation_prompt=add_gen, continue_final_message=cont,
    )


# --- completions ---

def _token_ids(v: list, param: str) -> tuple[int, ...]:
    if not v:
        raise bad(f"'{param}' must not be empty.", param, "empty_array")
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise bad(f"Invalid '{param}': token ids must be non-negative integers.", param,
                       "invalid_value")
    return tuple(v)


def _prompts(v: object) -> tuple[str | tuple[int, ...], ...]:
    """A string, an array of token ids, or an array of either: one prompt each."""
    if v is None:
        raise missing("prompt")
    if isinstance(v, str):
        return (v,)
    expected = "a string, an array of strings or an array of token ids"
    if not isinstance(v, list):
        raise invalid_type("prompt", expected, v)
    if not v:
        raise bad("'prompt' must not be empty.", "prompt", "empty_array")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return (_token_ids(v, "prompt"),)
    if len(v) > MAX_PROMPTS:
        raise bad(f"'prompt' holds {len(v)} prompts; kiln takes at most {MAX_PROMPTS} in "
                   "one request.", "prompt", "invalid_value")
    prompts = []
    for p in v:
        if isinstance(p, str):
            prompts.append(p)
        elif isinstance(p, list):
            prompts.append(_token_ids(p, "prompt"))
        else:
            raise invalid_type("prompt", expected, v)
    return tuple(prompts)


def parse_completion_request(body: object) -> CompletionRequest:
    """A /v1/completions body, checked; raises InvalidRequestError."""
    body = require_object(body)
    prompts = _prompts(body.get("prompt"))
    logprobs = integer(body, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise bad(f"Invalid 'logprobs': {logprobs}. Expected a value from 0 to "
                   f"{MAX_COMPLETION_LOGPROBS}.", "logprobs", "invalid_value")
    return CompletionRequest(prompts=prompts, **_common(body), logprobs=logprobs,
                             echo=bool(boolean(body, "echo")))
