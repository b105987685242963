"""Continuous batching with vLLM v1's rule: there is no prefill phase and no decode phase;
each request's num_computed_tokens catches up with its num_tokens, and one step packs the
decode tokens of running requests with prefill chunks, under a token budget.

Prefill chunks end on multiples of the chunk length counted from the start of the
conversation, also after a prefix-cache hit, and a chunk is never split by the budget.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.request import Request, RequestStatus
from kiln.runtime.kv.kv_cache_manager import KVCacheManager

log = logging.getLogger("kiln")


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    admitted: list[Request] = field(default_factory=list)  # of them, those that were waiting

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def prefill_chunk_plan(start: int, end: int, chunk_len: int) -> list[int]:
    """Sizes of the chunks that read tokens [start, end), each ending on a multiple of
    chunk_len from position 0 (or at end)."""
    sizes, pos = [], start
    while pos < end:
        stop = min(end, (pos // chunk_len + 1) * chunk_len)
        sizes.append(stop - pos)
        pos = stop
    return sizes


class Scheduler:
    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager):
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Counters since start, for /metrics: prompt tokens looked up in the prefix cache
        # at first admission, how many of them hit, and preemptions.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _num_new_tokens(self, request: Request, num_computed: int) -> int:
        """Up to the next chunk boundary: decode rows get their one token, and the drafts
        it checks (drafted within the boundary)."""
        chunk = self.config.prefill_chunk_len
        boundary = (num_computed // chunk + 1) * chunk
        # (the request's num_tokens_with_spec: a property read for every row of every step)
        return min(len(request.all_token_ids) + request.num_in_flight
                   + len(request.spec_token_ids), boundary) - num_computed

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.token_budget
        # Running requests first, oldest first; preempt the newest when blocks run out.
        running, allocate, scheduled = self.running, self.kv.allocate_slots, out.scheduled
        i = 0
        while i < len(running):
            req = running[i]
            n = self._num_new_tokens(req, req.num_computed_tokens)
            if n > budget or (req.num_in_flight and req.num_output_tokens + req.num_in_flight
                              >= req.max_tokens):  # its token in flight is its last
                i += 1
                continue
            while not allocate(req, n):
                victim = running.pop()
                self._preempt(victim)
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                i += 1
                if req.num_computed_tokens < len(req.prompt_token_ids):
                    self._log_prefill_chunk(req, n)
        # Then admit waiting requests, oldest first, while blocks, budget and seats allow; a
        # choice of an n > 1 request waits (without holding the queue) for its first
        # choice's prefill, whose blocks it then takes from the prefix cache.
        for req in list(self.waiting):
            if len(self.running) >= self.config.max_num_seqs or budget <= 0:
                break
            if req.waits_for_leader() or req.num_in_flight:
                continue  # (preempted with a token in flight: back once it is read)
            hits, num_cached = self.kv.get_computed_blocks(req) \
                if req.options.prompt_logprobs is None else ([], 0)
            n = self._num_new_tokens(req, num_cached)
            if n > budget:
                break
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.remove(req)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                self.prefix_queried_tokens += req.num_prompt_tokens
                self.prefix_hit_tokens += num_cached
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            out.admitted.append(req)
            budget -= n
            if req.num_computed_tokens < len(req.prompt_token_ids):
                self._log_prefill_chunk(req, n)
        return out

    def _log_prefill_chunk(self, req: Request, n: int) -> None:
        if req.num_prefill_chunks == 0:
            req.prefill_plan = prefill_chunk_plan(req.num_computed_tokens, req.num_tokens,
                                                  self.config.prefill_chunk_len)
        req.num_prefill_chunks += 1
        log.info("[kiln]  Prefill chunk %d/%d with %d tokens", req.num_prefill_chunks,
                 len(req.prefill_plan), n)

    def _preempt(self, req: Request) -> None:
        """Free its blocks; it is recomputed later (its output tokens become prompt-like)."""
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_prefill_chunks = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        log.info("[kiln]  Preempted request %s (out of KV blocks)", req.request_id)

    def update_after_step(self, scheduled: list[tuple[Request, int]],
                          rejected: dict[str, int] | None = None) -> None:
        """rejected: per request id, drafts the step checked and found wrong. Their positions
        hold no valid KV: they are not computed, and blocks they alone used go back."""
        bs = self.kv.block_size
        for req, n in scheduled:
            wrong = rejected.get(req.request_id, 0) if rejected else 0
            before = req.num_computed_tokens
            req.num_computed_tokens = after = before + n - wrong
            if after // bs > before // bs:  # a block filled (prefix hits are indexed already)
                self.kv.cache_full_blocks(req, after)
            if wrong:
                self.kv.trim(req, after + 1)

    def finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
