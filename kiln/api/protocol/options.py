"""What every generation route reads alike, whatever its dialect: the sampling fields (into
`SamplingFields`; their ranges are the sticky store's business) and the per-request engine
options (into the engine's own `RequestOptions`, which no later layer copies field by field).

A new per-request option is a field of RequestOptions and its reader here; the engine uses it.
"""

from __future__ import annotations

from kiln.api.protocol.fields import (
    array,
    as_strings,
    as_token_ids,
    bad,
    boolean,
    integer,
    invalid_type,
    json_object,
    number,
    string,
)
from kiln.kernels.sampling_metadata import MAX_TOP_LOGPROBS
from kiln.runtime.engine.engine_request import RequestOptions
from kiln.runtime.sampling.settings import SamplingFields

# MAX_TOP_LOGPROBS (chat's top_logprobs) is what the sampler gives, and OpenAI's limit too.
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' integer logprobs (OpenAI's limit)
MAX_N = 16  # choices per request (they share the prompt's prefill)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value

NUMBER_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
INTEGER_FIELDS = ("top_k", "repeat_last_n", "seed")


def sampling_fields(obj: dict, prefix: str = "", keys: dict[str, str] | None = None,
                    **given) -> SamplingFields:
    """The sampling fields of `obj`. prefix: where they sit in the body (Ollama's
    "options."); keys: the dialect's names for kiln's fields (Ollama's repeat_penalty);
    given: fields the dialect reads elsewhere (Ollama's think)."""
    keys = keys or {}
    values = {}
    for name in NUMBER_FIELDS + INTEGER_FIELDS:
        key = keys.get(name, name)
        read = number if name in NUMBER_FIELDS else integer
        values[name] = read(obj, key, prefix + key)
    if "think" not in given:
        values["think"] = boolean(obj, "think", prefix + "think")
    if "reasoning_effort" not in given:
        values["reasoning_effort"] = string(obj, "reasoning_effort", prefix + "reasoning_effort")
    return SamplingFields(**values, **given, param_prefix=prefix)


def max_tokens(body: dict) -> int | None:
    values = {key: integer(body, key) for key in ("max_completion_tokens", "max_tokens")}
    for key, v in values.items():
        if v is not None and v < 1:
            raise bad(f"Invalid '{key}': {v}. Expected a value >= 1.", key,
                      "integer_below_min_value")
    # max_completion_tokens replaces the deprecated max_tokens (vLLM reads them this way).
    if values["max_completion_tokens"] is not None:
        return values["max_completion_tokens"]
    return values["max_tokens"]


def stop(v: object, param: str = "stop") -> tuple[str, ...]:
    """A string or an array of strings; empty ones stop nothing and are dropped."""
    return tuple(s for s in as_strings(v, param) or () if s)


def n_choices(body: dict) -> int:
    n = integer(body, "n")
    if n is not None and not 1 <= n <= MAX_N:
        raise bad(f"Invalid 'n': {n}. Expected a value from 1 to {MAX_N}.", "n",
                  "invalid_value")
    return n or 1


def logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
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


def min_tokens(body: dict) -> int:
    v = integer(body, "min_tokens")
    if v is not None and v < 0:
        raise bad(f"Invalid 'min_tokens': {v}. Expected a value >= 0.", "min_tokens",
                  "integer_below_min_value")
    return v or 0


def top_logprobs(body: dict, param: str = "top_logprobs") -> int | None:
    """Chat's logprobs: `logprobs: true` and `top_logprobs` alternatives (up to 20) per token;
    None without logprobs."""
    logprobs = bool(boolean(body, "logprobs"))
    top = integer(body, "top_logprobs", param) or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad(f"Invalid '{param}': {top}. Expected a value from 0 to "
                  f"{MAX_TOP_LOGPROBS}.", param, "invalid_value")
    if top and not logprobs:
        raise bad("top_logprobs needs logprobs: true.", param, "invalid_value")
    return top if logprobs else None


def stop_token_ids(body: dict) -> frozenset[int]:
    v = array(body, "stop_token_ids")
    return frozenset(as_token_ids(v, "stop_token_ids")) if v else frozenset()


def request_options(body: dict, logprobs: int | None = None,
                    prompt_logprobs: int | None = None) -> RequestOptions:
    """The options /v1's generation routes read alike; logprobs, whose shape differs between
    chat and completions, are read by each route."""
    return RequestOptions(
        max_tokens=max_tokens(body), stop=stop(body.get("stop")),
        stop_token_ids=stop_token_ids(body),
        ignore_eos=bool(boolean(body, "ignore_eos")), min_tokens=min_tokens(body),
        logit_bias=logit_bias(body), logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def include_usage(body: dict) -> bool:
    stream_options = json_object(body, "stream_options") or {}
    return bool(boolean(stream_options, "include_usage", "stream_options.include_usage"))
