"""Ollama's /api/chat and /api/generate bodies, read into the chat and completion requests of
kiln's own routes (api/protocol/chat.py, completions.py), so a request on Ollama's routes meets
every check and every sticky-settings rule of /v1, with its 400s naming the fields as the
client wrote them (`options.repeat_last_n`, `format`).

What is Ollama's own is read here: `options` (kiln's sampling fields, `num_predict` as the
reply's limit, -1 and -2 meaning none, so a reply ends where the context is full; the runner's
options type-checked and ignored), `format` ("json" or a JSON schema), `think` (true/false, or
an effort), messages with `thinking`, `tool_name` and tool-call arguments as objects, and
`stream` (true unless sent false). Images are refused: kiln reads text only.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.api.protocol.chat import (
    ChatCompletionRequest,
    ChatMessage,
    ResponseFormat,
    read_message,
    read_tools,
)
from kiln.api.protocol.completions import CompletionRequest
from kiln.api.protocol.fields import (
    as_integer,
    as_number,
    as_typed,
    bad,
    invalid_type,
    typed,
    unsupported,
)
from kiln.api.protocol.options import MAX_TOP_LOGPROBS, sampling_fields, stop
from kiln.runtime.engine.engine_request import RequestOptions
from kiln.runtime.errors import InvalidRequestError

# Ollama's runner and load options: type-checked as Ollama does, otherwise ignored.
RUNNER_OPTIONS: dict[str, str] = {
    "num_ctx": "integer", "num_batch": "integer", "num_gpu": "integer", "main_gpu": "integer",
    "num_thread": "integer", "num_keep": "integer", "draft_num_predict": "integer",
    "mirostat": "integer", "typical_p": "number", "tfs_z": "number", "mirostat_tau": "number",
    "mirostat_eta": "number", "use_mmap": "boolean", "use_mlock": "boolean",
    "numa": "boolean", "low_vram": "boolean", "f16_kv": "boolean", "vocab_only": "boolean",
    "logits_all": "boolean", "embedding_only": "boolean", "penalize_newline": "boolean",
}
SAMPLING_KEYS = {"repetition_penalty": "repeat_penalty"}  # kiln's field -> Ollama's option
THINK_LEVELS = {"low": "low", "medium": "medium", "high": "high", "max": "high"}


@dataclass(frozen=True)
class OllamaRequest:
    """One /api/chat or /api/generate request: the chat request it runs as (/api/chat, a
    templated /api/generate), or the completion request of a raw prompt; neither when it
    only asks for the model to be loaded (no messages, an empty prompt)."""

    model: str
    stream: bool
    chat: ChatCompletionRequest | None = None
    completion: CompletionRequest | None = None  # raw: the prompt as it is, no template
    raw_format: ResponseFormat | None = None  # a raw prompt's `format`

    @property
    def load_only(self) -> bool:
        return self.chat is None and self.completion is None

    @property
    def raw(self) -> bool:
        return self.completion is not None

    @property
    def top_logprobs(self) -> int | None:
        """Logprobs asked for: this many alternatives per token."""
        request = self.chat or self.completion
        return request.options.logprobs if request is not None else None


def chat_request(body: dict) -> OllamaRequest:
    messages = typed(body, "messages", list, "an array") or []
    model, stream, sampling, options, fmt = _common(body)
    chat = ChatCompletionRequest(
        messages=tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages)),
        sampling=sampling, options=options, model=model,
        tools=read_tools(typed(body, "tools", list, "an array") or []),
        response_format=fmt)
    return OllamaRequest(model, stream, chat=chat if messages else None)


def generate_request(body: dict) -> OllamaRequest:
    prompt = typed(body, "prompt", str, "a string") or ""
    system = typed(body, "system", str, "a string")
    raw = bool(typed(body, "raw", bool, "a boolean"))
    if typed(body, "suffix", str, "a string"):
        raise InvalidRequestError(f"{body.get('model')!r} does not support insert: kiln "
                                  "has no fill-in-the-middle prompt for it.", param="suffix")
    if typed(body, "template", str, "a string"):
        raise InvalidRequestError("'template' is not supported: kiln renders prompts with "
                                  "the model's own chat template (or none, with raw).",
                                  param="template")
    if raw and system:
        raise InvalidRequestError("raw mode does not support template, system, or context",
                                  param="raw")
    _no_images(body, "images")
    model, stream, sampling, options, fmt = _common(body, raw=raw)
    if not prompt:
        return OllamaRequest(model, stream)
    if raw:
        return OllamaRequest(model, stream, raw_format=fmt, completion=CompletionRequest(
            prompts=(prompt,), sampling=sampling, options=options, model=model))
    messages = ([ChatMessage("system", system)] if system else []) + \
        [ChatMessage("user", prompt)]
    return OllamaRequest(model, stream, chat=ChatCompletionRequest(
        messages=tuple(messages), sampling=sampling, options=options, model=model,
        response_format=fmt))


def response_format(body: dict) -> ResponseFormat | None:
    """`format`: "json" -> a JSON object, a schema -> that schema."""
    fmt = body.get("format")
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return ResponseFormat("json_object", param="format")
    if isinstance(fmt, dict):
        return ResponseFormat("json_schema", fmt, "format", param="format")
    raise InvalidRequestError(f"Invalid 'format': {fmt!r}. Expected \"json\" or a JSON "
                              "schema object.", param="format")


def model_name(body: dict) -> str:
    """The model a /api/show or /api/pull body names (`name`: older clients)."""
    name = body.get("model") or body.get("name")
    if name is None:
        raise InvalidRequestError("model is required", param="model")
    if not isinstance(name, str):
        raise invalid_type("model", "a string", name)
    return name


# --- pieces ---------------------------------------------------------------------------------

def _common(body: dict, raw: bool = False):
    """What both routes read alike: (model, stream, sampling fields, options, format)."""
    model = typed(body, "model", str, "a string")
    if not model:
        raise InvalidRequestError("model is required", param="model")
    options = typed(body, "options", dict, "an object") or {}
    for name, kind in RUNNER_OPTIONS.items():
        _checked(options.get(name), kind, f"options.{name}")
    # A raw prompt has no template to think in: think is not read there.
    think = {"think": None, "reasoning_effort": None} if raw else _think(body.get("think"))
    sampling = sampling_fields(options, "options.", SAMPLING_KEYS, **think)
    fmt = response_format(body)
    stream = typed(body, "stream", bool, "a boolean")
    return model, stream is not False, sampling, RequestOptions(
        max_tokens=_num_predict(options.get("num_predict")),
        stop=stop(options.get("stop"), "options.stop"), logprobs=_logprobs(body)), fmt


def _num_predict(value) -> int | None:
    n = as_integer(value, "options.num_predict")
    if n is not None and n < -2:
        raise bad(f"Invalid 'options.num_predict': {n}. Expected a positive count, -1 (no "
                  "limit) or -2 (fill the context).", "options.num_predict",
                  "integer_below_min_value")
    return n if n is not None and n > 0 else None  # no limit: ends where the context is full


def _logprobs(body: dict) -> int | None:
    if not typed(body, "logprobs", bool, "a boolean"):
        return None
    top = as_integer(body.get("top_logprobs"), "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}",
                                  param="top_logprobs")
    return top or 0


def _checked(value, kind: str, param: str) -> None:
    if kind == "integer":
        as_integer(value, param)
    elif kind == "number":
        as_number(value, param)
    else:
        as_typed(value, bool, "a boolean", param)


def _think(value) -> dict:
    if value is None:
        return {"think": None, "reasoning_effort": None}
    if isinstance(value, bool):
        return {"think": value, "reasoning_effort": None}
    if isinstance(value, str) and value in THINK_LEVELS:
        return {"think": True, "reasoning_effort": THINK_LEVELS[value]}
    raise InvalidRequestError(f"Invalid 'think': {value!r}. Expected true, false, \"low\", "
                              "\"medium\" or \"high\".", param="think")


def _message(m, param: str) -> ChatMessage:
    """An Ollama message, read as /v1 reads one once its own fields are translated."""
    if not isinstance(m, dict):
        raise invalid_type(param, "an object", m)
    _no_images(m, f"{param}.images")
    out = {k: v for k, v in m.items()
           if k in ("role", "content", "tool_calls", "tool_call_id")}
    thinking = typed(m, "thinking", str, "a string", f"{param}.thinking")
    if thinking:
        out["reasoning_content"] = thinking
    tool_name = typed(m, "tool_name", str, "a string", f"{param}.tool_name")
    if tool_name and m.get("role") == "tool":
        out["name"] = tool_name
    if out.get("content") is None and out.get("role") == "assistant" \
            and not out.get("tool_calls"):
        out["content"] = ""  # Ollama's empty assistant turn
    return read_message(out, param)


def _no_images(obj: dict, param: str) -> None:
    if typed(obj, "images", list, "an array", param):
        raise unsupported("Images are not supported: kiln's models read text only.", param)
