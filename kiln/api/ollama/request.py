"""Ollama request bodies -> the /v1 bodies kiln's own parsers check (api/protocol.py), so a
request on /api/chat or /api/generate meets every check and every sticky-settings rule of
/v1/chat/completions and /v1/completions.

What is Ollama's own is read here: `options` (each known option's JSON type is checked and
named `options.<name>` in a 400; kiln's sampling fields are taken, the runner's ignored),
`num_predict` (-1 and -2: no limit, kiln then stops where the context is full), `format`
("json" or a JSON schema -> response_format), `think` (true/false, or an effort), messages
with `thinking`, `tool_name` and tool-call arguments as objects, and `stream` (true unless
sent false). Images are refused: kiln reads text only.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.api.json_fields import invalid_type, typed
from kiln.runtime.errors import InvalidRequestError

# Ollama option -> (the /v1 field it becomes, or None when kiln has no use for it; JSON kind)
OPTIONS: dict[str, tuple[str | None, str]] = {
    "temperature": ("temperature", "number"),
    "top_p": ("top_p", "number"),
    "top_k": ("top_k", "integer"),
    "min_p": ("min_p", "number"),
    "presence_penalty": ("presence_penalty", "number"),
    "frequency_penalty": ("frequency_penalty", "number"),
    "repeat_penalty": ("repetition_penalty", "number"),
    "repeat_last_n": ("repeat_last_n", "integer"),
    "seed": ("seed", "integer"),
    "stop": ("stop", "strings"),
    "num_predict": ("max_tokens", "integer"),
    # Ollama's runner and load settings: type-checked as Ollama does, otherwise ignored.
    "num_ctx": (None, "integer"), "num_batch": (None, "integer"),
    "num_gpu": (None, "integer"), "main_gpu": (None, "integer"),
    "num_thread": (None, "integer"), "num_keep": (None, "integer"),
    "draft_num_predict": (None, "integer"), "mirostat": (None, "integer"),
    "typical_p": (None, "number"), "tfs_z": (None, "number"),
    "mirostat_tau": (None, "number"), "mirostat_eta": (None, "number"),
    "use_mmap": (None, "boolean"), "use_mlock": (None, "boolean"),
    "numa": (None, "boolean"), "low_vram": (None, "boolean"), "f16_kv": (None, "boolean"),
    "vocab_only": (None, "boolean"), "logits_all": (None, "boolean"),
    "embedding_only": (None, "boolean"), "penalize_newline": (None, "boolean"),
}
THINK_LEVELS = {"low": "low", "medium": "medium", "high": "high", "max": "high"}
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class OllamaRequest:
    """One /api/chat or /api/generate request, as far as the route itself needs it; `v1` is
    the equivalent /v1 body, for parse_chat_request or parse_completion_request."""

    model: str
    stream: bool
    v1: dict
    load_only: bool = False  # no messages / an empty prompt: load the model and answer
    raw: bool = False  # /api/generate's raw prompt: no template
    prompt: str = ""  # the raw prompt
    top_logprobs: int | None = None  # logprobs asked for: this many alternatives
    raw_format: dict | None = None  # a raw prompt's `format`, as a response_format


def chat_request(body: dict) -> OllamaRequest:
    messages = typed(body, "messages", list, "an array") or []
    v1 = _common(body)
    v1["messages"] = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    tools = typed(body, "tools", list, "an array")
    if tools:
        v1["tools"] = tools  # Ollama's tool shape is OpenAI's
    return OllamaRequest(model=v1["model"], stream=_stream(body), v1=v1,
                         load_only=not messages, top_logprobs=_top_logprobs(v1))


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
    v1 = _common(body)
    top_logprobs, raw_format = _top_logprobs(v1), None
    if raw:  # a /v1/completions body: logprobs there is a count, and there is no format
        for key in ("logprobs", "top_logprobs", "think", "reasoning_effort"):
            v1.pop(key, None)
        raw_format = v1.pop("response_format", None)
    else:
        v1["messages"] = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
    return OllamaRequest(model=v1["model"], stream=_stream(body), v1=v1,
                         load_only=not prompt, raw=raw, prompt=prompt,
                         top_logprobs=top_logprobs, raw_format=raw_format)


def response_format(body: dict) -> dict | None:
    """`format` as /v1's response_format: "json" -> json_object, a schema -> json_schema."""
    fmt = body.get("format")
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise InvalidRequestError(f"Invalid 'format': {fmt!r}. Expected \"json\" or a JSON "
                              "schema object.", param="format")


# --- pieces ---------------------------------------------------------------------------------

def _common(body: dict) -> dict:
    """The /v1 fields both routes share: model, options, format, think, logprobs."""
    model = typed(body, "model", str, "a string")
    if not model:
        raise InvalidRequestError("model is required", param="model")
    v1: dict = {"model": model, **_options(body)}
    fmt = response_format(body)
    if fmt is not None:
        v1["response_format"] = fmt
    v1.update(_think(body.get("think")))
    if typed(body, "logprobs", bool, "a boolean"):
        v1["logprobs"] = True
        top = _integer(body.get("top_logprobs"), "top_logprobs")
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("top_logprobs must be between 0 and 20",
                                      param="top_logprobs")
        v1["top_logprobs"] = top or 0
    return v1


def _options(body: dict) -> dict:
    options = typed(body, "options", dict, "an object") or {}
    fields = {}
    for name, value in options.items():
        if name not in OPTIONS or value is None:
            continue  # Ollama logs an unknown option and goes on
        field, kind = OPTIONS[name]
        value = _checked(value, kind, f"options.{name}")
        if field == "max_tokens":
            if value < -2:
                raise InvalidRequestError(
                    f"Invalid 'options.num_predict': {value}. Expected a positive count, -1 "
                    "(no limit) or -2 (fill the context).", param="options.num_predict",
                    code="integer_below_min_value")
            if value <= 0:
                continue  # no limit: the reply ends where the context is full
        if field is not None:
            fields[field] = value
    return fields


def _checked(value, kind: str, param: str):
    if kind == "integer":
        return _integer(value, param)
    if kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid_type(param, "a number", value)
    elif kind == "boolean":
        if not isinstance(value, bool):
            raise invalid_type(param, "a boolean", value)
    elif kind == "strings":
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise invalid_type(param, "an array of strings", value)
    return value


def _integer(value, param: str) -> int | None:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise invalid_type(param, "an integer", value)
    return value


def _think(value) -> dict:
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"think": value}
    if isinstance(value, str) and value in THINK_LEVELS:
        return {"think": True, "reasoning_effort": THINK_LEVELS[value]}
    raise InvalidRequestError(f"Invalid 'think': {value!r}. Expected true, false, \"low\", "
                              "\"medium\" or \"high\".", param="think")


def _message(m, param: str):
    """An Ollama message as /v1 writes it (parse_chat_request checks the rest)."""
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
    return out


def _no_images(obj: dict, param: str) -> None:
    if typed(obj, "images", list, "an array", param):
        raise InvalidRequestError("Images are not supported: kiln's models read text only.",
                                  param=param, code="unsupported_value")


def _stream(body: dict) -> bool:
    stream = typed(body, "stream", bool, "a boolean")
    return True if stream is None else stream


def _top_logprobs(v1: dict) -> int | None:
    return v1.get("top_logprobs", 0) if v1.get("logprobs") else None


def model_name(body: dict) -> str:
    """The model a /api/show or /api/pull body names (`name`: older clients)."""
    name = body.get("model") or body.get("name")
    if name is None:
        raise InvalidRequestError("model is required", param="model")
    if not isinstance(name, str):
        raise invalid_type("model", "a string", name)
    return name
