"""/v1/completions' body as a checked, typed request (`parse_completion_request`); Ollama's raw
/api/generate builds the same type."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.api.protocol.fields import (
    as_token_ids,
    bad,
    boolean,
    integer,
    invalid_type,
    missing,
    require_object,
    string,
)
from kiln.api.protocol.options import (
    MAX_COMPLETION_LOGPROBS,
    include_usage,
    n_choices,
    request_options,
    sampling_fields,
)
from kiln.runtime.engine.engine_request import RequestOptions
from kiln.runtime.sampling.settings import SamplingFields

MAX_PROMPTS = 64  # prompts in one request


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompts: tuple[str | tuple[int, ...], ...]  # each text, or token ids; one choice set each
    sampling: SamplingFields
    # logprobs: how many top alternatives per token, None = none; with echo, the prompt's too
    options: RequestOptions = field(default_factory=RequestOptions)
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    n: int = 1
    user: str | None = None

    @property
    def prompt(self) -> str | tuple[int, ...]:
        """The first prompt (most requests send one)."""
        return self.prompts[0]


def _token_ids(v: list, param: str) -> tuple[int, ...]:
    if not v:
        raise bad(f"'{param}' must not be empty.", param, "empty_array")
    return as_token_ids(v, param)


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
    sampling = sampling_fields(body)
    logprobs = integer(body, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise bad(f"Invalid 'logprobs': {logprobs}. Expected a value from 0 to "
                  f"{MAX_COMPLETION_LOGPROBS}.", "logprobs", "invalid_value")
    echo = bool(boolean(body, "echo"))
    return CompletionRequest(
        prompts=prompts, sampling=sampling,
        options=request_options(body, logprobs=logprobs,
                                prompt_logprobs=logprobs if echo else None),
        model=string(body, "model"), stream=bool(boolean(body, "stream")),
        include_usage=include_usage(body), echo=echo, n=n_choices(body),
        user=string(body, "user"))
