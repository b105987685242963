"""A request inside the engine: its tokens, its progress, its blocks' keys, its outputs."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kiln.runtime.engine.engine_request import RequestOptions
from kiln.runtime.sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch

    from kiln.runtime.drafting.pace import DraftPace
    from kiln.runtime.sampling.grammar import GrammarState
    from kiln.runtime.text.stop_strings import StopStringChecker


class RequestStatus(enum.Enum):
    # (value, the API's finish_reason); read for every row of every step, so plain
    # attributes of the members rather than properties over `value` (an enum descriptor)
    WAITING = (1, None)
    RUNNING = (2, None)
    PREEMPTED = (3, None)
    FINISHED_STOPPED = (4, "stop")
    FINISHED_LENGTH = (5, "length")
    FINISHED_ABORTED = (6, "abort")

    def __init__(self, _: int, finish_reason: str | None):
        self.finish_reason = finish_reason
        self.is_finished = finish_reason is not None


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-N (token id, logprob), most likely first


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    first_token_time: float | None
    arrival_time: float
    # With a request's first output only, when it asked: one entry per prompt token, the
    # first None (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_accepted_tokens: int = 0  # drafted tokens the model agreed with, so far
    num_rejected_tokens: int = 0  # drafted tokens it did not


class InFlightTokens:
    """The tokens a step sampled on the device that the host has not read yet
    (--async-scheduling): the next step's inputs, and penalty windows, for those rows."""

    def __init__(self, token_ids: torch.Tensor, requests: list[Request]):
        self.token_ids = token_ids  # [rows] int64, on the device
        self.requests = requests  # row i's request
        self._rows: dict[Request, int] | None = None

    def rows_of(self, requests: list[Request]) -> np.ndarray | None:
        """Each request's row in token_ids, or -1 where it has none; None where `requests`
        are these rows in their order (a run of decode steps: no lookup)."""
        if requests == self.requests:  # identity per element: one C loop
            return None
        if self._rows is None:
            self._rows = {r: i for i, r in enumerate(self.requests)}
        rows = self._rows
        return np.fromiter((rows.get(r, -1) for r in requests), np.int64, len(requests))


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int  # already capped by the context
    options: RequestOptions = field(default_factory=RequestOptions)  # as the client sent them
    stop_token_ids: frozenset[int] = frozenset()  # the model's and the options' own
    # n > 1: a sibling waits for the first choice's prefill, then takes its prompt's full
    # blocks from the prefix cache instead of prefilling them again. The leader is named by
    # its id (the API thread, or another process, cannot hold the engine's Request) and found
    # when the sibling is added; a leader the engine does not hold is no leader.
    prefill_leader_id: str | None = None
    prefill_leader: Request | None = None
    window_prefix: list[int] = field(default_factory=list)  # carried from a cached reply
    grammar: GrammarState | None = None  # structured output; stepped by the engine thread
    stop_strings: StopStringChecker | None = None  # fed each token by the engine thread
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # The output tokens the penalties see: all but those a grammar dictated (penalty_window.py)
    window_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # --async-scheduling: tokens sampled on the device and not yet read by the host (0 or 1
    # when a step is scheduled), counted as the request's tokens by the scheduler
    num_in_flight: int = 0
    num_cached_tokens: int = -1  # set when first scheduled
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, chained
    first_token_time: float | None = None
    prompt_logprob_entries: list[TokenLogprob | None] = field(default_factory=list)
    num_prefill_chunks: int = 0
    prefill_plan: list[int] = field(default_factory=list)  # chunk sizes, for the log
    # Speculative decoding (runtime/drafting): the drafts its next step checks after its last
    # token, the drafter's own state for it, how far it drafts, what it drafted and kept.
    spec_token_ids: list[int] = field(default_factory=list)
    draft_state: object | None = None
    draft_pace: DraftPace | None = None
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + self.num_in_flight + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def drafts_change_nothing(self) -> bool:
        """Greedy without penalties: a kept draft is the argmax of the raw logits with the
        logit_bias added, which is what its sampler picks too (a grammar's or min_tokens'
        refusal sends the position to the sampler), so its reply is the same with drafts or
        without (contract.md)."""
        return self.sampling.is_greedy and not self.sampling.has_penalties

    @property
    def samples_ahead(self) -> bool:
        """Its next step may start before the host reads this step's token
        (--async-scheduling): the sampler needs that token on the host only for a grammar's
        mask (a penalty window takes it on the device)."""
        return self.grammar is None

    def waits_for_leader(self) -> bool:
        leader = self.prefill_leader
        return leader is not None and not leader.is_finished \
            and leader.num_computed_tokens < leader.num_prompt_tokens

    def append_output_token(self, token_id: int, dictated: bool = False) -> None:
        """dictated: the grammar left no other text here, or the token was drafted and
        accepted: it is not the model's sample and stays out of the penalty window."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if not dictated:
            self.window_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason
