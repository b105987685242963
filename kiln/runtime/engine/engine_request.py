"""What every engine takes: one request, fully decided by whoever admitted it.

`RequestOptions` are a client's per-request generation options besides sampling (api/protocol
reads them, from every dialect, into this one type); `EngineRequest` adds the prompt, the
admitted sampling snapshot, the grammar and the n > 1 leader. Both are frozen and plain, so a
cluster sends them to its replicas as they are, and both check their invariants where they are
built (a client's 400s, naming its fields, are api/protocol's).

`check_fits` checks a request against an engine's config: the API calls it before admitting the
sticky settings (a refused request changes nothing), every engine again when adding one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.kernels.sampling_metadata import MAX_TOP_LOGPROBS
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.errors import ContextLengthError, InvalidRequestError, KVCacheCapacityError
from kiln.runtime.sampling.grammar import GrammarSpec
from kiln.runtime.sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """Per-request generation options (none of them sticky)."""

    max_tokens: int | None = None  # None: until the context or the KV pool is full
    stop: tuple[str, ...] = ()  # stop strings
    stop_token_ids: frozenset[int] = frozenset()  # more tokens that end it, beside the model's
    ignore_eos: bool = False  # (a grammar still ends at its stop token)
    min_tokens: int = 0  # stop tokens are banned until the reply has this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique
    logprobs: int | None = None  # the top-N alternatives of each output token; None: none
    # The prompt tokens' logprobs (completions' echo), top-N each; computed while the prompt
    # is prefilled, so such a request never reads the prefix cache.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "logit_bias", tuple(self.logit_bias))
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens {self.max_tokens} must be >= 1")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens {self.min_tokens} must be >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} {n} must be in 0..{MAX_TOP_LOGPROBS}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(t < 0 for t in ids):
            raise ValueError("logit_bias token ids must be unique and non-negative")
        if not all(self.stop):
            raise ValueError("stop strings must not be empty")


@dataclass(frozen=True, slots=True)
class EngineRequest:
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams  # the admitted snapshot of the sticky settings
    options: RequestOptions = field(default_factory=RequestOptions)
    grammar: GrammarSpec | None = None  # structured output; each engine compiles its own
    grammar_prefix: str = ""  # text of the reply the grammar must accept first (a continuation)
    # n > 1: choice 0's request id. A sibling waits for the leader's prefill, then reads the
    # prompt's blocks from the prefix cache; a leader the engine does not hold is no leader.
    prefill_leader: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError("empty prompt")
        if self.grammar_prefix and self.grammar is None:
            raise ValueError("a grammar prefix needs a grammar")


def check_fits(config: EngineConfig, vocab_size: int, num_prompt_tokens: int,
               options: RequestOptions) -> None:
    """The context first (the contract's error), then the KV pool: a request must fit in the
    whole pool alone, or it could never run; then the token ids of logit_bias and
    stop_token_ids, against the model's logits width (which the API's parsers do not know)."""
    ctx, max_tokens = config.ctx_len, options.max_tokens
    kv_tokens = config.num_blocks * config.block_size
    if num_prompt_tokens >= ctx or (max_tokens is not None
                                    and num_prompt_tokens + max_tokens > ctx):
        raise ContextLengthError(num_prompt_tokens=num_prompt_tokens,
                                 max_tokens=max_tokens, ctx_len=ctx)
    if num_prompt_tokens + (max_tokens or 1) > kv_tokens:
        raise KVCacheCapacityError(num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens,
                                   kv_cache_tokens=kv_tokens)
    for param, ids in (("logit_bias", [t for t, _ in options.logit_bias]),
                       ("stop_token_ids", sorted(options.stop_token_ids))):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"Invalid '{param}': token id {bad[0]} is outside the "
                                      f"vocabulary (size {vocab_size}).", param=param,
                                      code="invalid_value")
