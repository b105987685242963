"""The engine's synchronous core: requests in (`add_request`, `abort`), one batched step at a
time (`step`), outputs out. `AsyncEngine` (async_engine.py) runs it on a thread of its own."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kiln.kernels.sampling_metadata import SamplerOutput
from kiln.kernels.warmup import KernelShapes, warmup_launches
from kiln.runtime.drafting.drafter import make_drafter
from kiln.runtime.drafting.pace import DraftPace
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.engine_request import EngineRequest, check_fits
from kiln.runtime.engine.model_runner import ModelInput, ModelRunner
from kiln.runtime.engine.reply_tails import ReplyTails
from kiln.runtime.engine.request import InFlightTokens, Request, RequestOutput, RequestStatus
from kiln.runtime.engine.scheduler import Scheduler
from kiln.runtime.engine.stats import EngineStats
from kiln.runtime.kv.kv_cache_manager import KVCacheManager
from kiln.runtime.models.loader import LoadedModel
from kiln.runtime.sampling.grammar import GrammarCompilerCache, GrammarState
from kiln.runtime.sampling.sampler import (
    CopyOut,
    Sampler,
    raw_choices,
    to_token_logprobs,
)
from kiln.runtime.text.stop_strings import StopStringChecker

log = logging.getLogger("kiln")


@dataclass
class InFlight:
    """A launched step whose samples the host has not read yet (--async-scheduling)."""

    requests: list[Request]  # its rows, in order
    tokens: InFlightTokens  # the next step's inputs for them, on the device
    copy: CopyOut  # their way to the host


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig):
        self.loaded, self.config = loaded, config
        self.kv = KVCacheManager(config.num_blocks, config.block_size,
                                 model_id=f"{loaded.path.name}:{loaded.path.stat().st_size}")
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(loaded.model, loaded.config, config, self.kv)
        self.sampler = Sampler(self.runner.device, config.use_triton)
        self.requests: dict[str, Request] = {}
        self.stalled = False  # the last step scheduled nothing
        self.reply_tails = ReplyTails(config.block_size)
        self.grammars = GrammarCompilerCache(loaded.tokenizer,
                                             vocab_size=loaded.config.vocab_size)
        self.drafter = make_drafter(config.speculative) if config.speculative else None
        # A drafting step needs its tokens on the host to draft the next: never in flight.
        self.async_scheduling = config.async_scheduling and self.drafter is None
        self.in_flight: InFlight | None = None  # a step whose tokens the host has not read
        self.num_draft_tokens = self.num_accepted_tokens = 0  # counters since start
        if config.use_triton and self.runner.device.type == "cuda":
            self._prepare_gpu()

    def _prepare_gpu(self) -> None:
        """At load, not mid-reply: compile every kernel variant this model's steps launch (a
        variant first met by a step would stall every stream for its compile, 0.5-5 s),
        then capture the decode graphs."""
        t0 = time.perf_counter()
        model = self.loaded.model
        launches = warmup_launches(KernelShapes.of(model), model.backend.dtype,
                                   model.logits_dtype, self.runner.device,
                                   model.backend.batch_invariant)
        for _, launch in launches:
            launch()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        log.info("[kiln]  Compiled %d kernel variants in %.1f s", len(launches), t1 - t0)
        runner = self.runner
        if runner.graphs is not None:
            pool = runner.pieces.capture()  # the largest intermediates first
            for graphs in (runner.graphs, runner.spec_graphs):
                if graphs is not None:
                    pool = graphs.capture(pool)
            drafts = " (with the sampler, and with drafts)" if runner.spec_graphs is not None \
                else " (with the sampler)"
            log.info("[kiln]  Captured CUDA graphs in %.1f s: decode%s for batch sizes %s, "
                     "the pieces between attentions for steps of up to %s tokens",
                     time.perf_counter() - t1, drafts, ",".join(map(str, runner.graphs.sizes)),
                     ",".join(map(str, runner.pieces.sizes)))

    @property
    def vocab_size(self) -> int:
        """The model's logits width (what logit_bias ids are checked against)."""
        return self.loaded.config.vocab_size

    def make_request(self, request_id: str, request: EngineRequest) -> Request:
        """Validate against the context and the KV pool (the prompt is never truncated) and
        compile the grammar: blocking when it is not cached yet. A reply without max_tokens
        ends ("length") where the context or the pool is full."""
        options = request.options
        prompt = list(request.prompt_token_ids)
        check_fits(self.config, self.vocab_size, len(prompt), options)
        room = min(self.config.ctx_len, self.config.num_blocks * self.config.block_size) \
            - len(prompt)
        grammar = None
        if request.grammar is not None:
            grammar = GrammarState(self.grammars.get(request.grammar), request.grammar_prefix,
                                   self.grammars.token_bytes)
        tokenizer = self.loaded.tokenizer
        # bench/gpu_check's random-weight models come without a tokenizer: no stops of their own.
        model_stops = tokenizer.stop_token_ids if tokenizer is not None else frozenset()
        return Request(
            request_id=request_id, prompt_token_ids=prompt, sampling=request.sampling,
            max_tokens=min(options.max_tokens, room) if options.max_tokens is not None
            else room, options=options,
            stop_token_ids=model_stops | options.stop_token_ids,
            prompt_logprob_entries=[None] if options.prompt_logprobs is not None else [],
            prefill_leader_id=request.prefill_leader, grammar=grammar,
            stop_strings=StopStringChecker(tokenizer, list(options.stop))
            if options.stop else None)

    def add_request(self, req: Request) -> None:
        if req.prefill_leader_id is not None:
            req.prefill_leader = self.requests.get(req.prefill_leader_id)
        self.requests[req.request_id] = req
        self.scheduler.add_request(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self._output(req, [], None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One step: schedule, launch, sample. With --async-scheduling, where every row that
        samples can (`Request.samples_ahead`), the step's tokens stay on the device and are
        read in the next step, after that step is launched: the host schedules, stages and
        launches while the device still runs this one, and a reply's tokens reach it a step
        later. A row whose request ends on the token in flight is computed in vain."""
        if self.drafter is not None:
            self._draft()
        sched = self.scheduler.schedule()
        landing, self.in_flight = self.in_flight, None
        # Nothing schedulable although requests wait: only an add or abort can change that.
        self.stalled = not sched.scheduled and landing is None
        if not sched.scheduled:
            return self._land(landing)
        for req in sched.admitted:  # a reply's first step: the tail it carries, if any
            if req.num_computed_tokens == req.num_cached_tokens and not req.output_token_ids \
                    and req.sampling.seed is None and req.sampling.has_penalties:
                req.window_prefix = self.reply_tails.lookup(req.prompt_token_ids,
                                                            req.num_cached_tokens)
        inp = self.runner.prepare(sched.scheduled, landing and landing.tokens)
        logits = self.runner.execute(inp)
        reqs = inp.sampling_requests
        if logits is None or (self.async_scheduling and len(logits) == len(reqs)
                              and all(req.samples_ahead for req in reqs)):
            if logits is not None:  # launch the sampler, read its tokens next step
                out = self._sample(logits, inp, landing and landing.tokens)
                self.in_flight = InFlight(reqs, InFlightTokens(out.token_ids, reqs),
                                          self.sampler.copy_out(out))
                for req in reqs:
                    req.num_in_flight += 1
            outputs = self._land(landing)  # the blocks filled need its tokens' hashes
            self.scheduler.update_after_step(_unfinished(sched.scheduled, outputs))
            return outputs
        landed = self._land(landing)
        now = time.monotonic()
        finished: dict[Request, RequestStatus] = {}
        # Per request, this step's tokens and logprobs: the drafts it kept, then its sample.
        new, rejected = self._check_drafts(logits, inp, finished, now) \
            if len(logits) > len(reqs) else ({}, {})
        if new:  # a drafted row samples after its kept drafts, unless they finished it
            starts = np.cumsum([0, *inp.num_logits_rows[:-1]]).tolist()
            sample = [(req, start + len(new[req][0]) if req in new else start)
                      for req, start in zip(reqs, starts) if req not in finished]
            sample_reqs = [req for req, _ in sample]
            rows = logits[[row for _, row in sample]]
        else:
            sample_reqs, rows = reqs, logits
        sampled = []  # (request, token, logprob entry)
        if sample_reqs:
            # The step's one device sync (with drafts, its second: raw_choices reads first).
            out = self.sampler.fetch(self._sample(rows, inp, None, sample_reqs if new else None))
            sampled = list(zip(sample_reqs, out.token_ids, to_token_logprobs(out, sample_reqs)))
            if any(o.finished for o in landed):  # (ended by the token just read)
                sampled = [row for row in sampled if not row[0].is_finished]
            for req, token, _ in sampled:
                if (status := self._take(req, token, now)) is not None:
                    finished[req] = status
        self.scheduler.update_after_step(_unfinished(sched.scheduled, landed), rejected)
        self._finish(finished)
        if not new:  # no drafts: every row sampled its one token (most steps)
            return landed + [self._output(req, [token], [lp]) for req, token, lp in sampled]
        for req, token, lp in sampled:
            tokens, logprobs = new.setdefault(req, ([], []))
            tokens.append(token)
            logprobs.append(lp)
        return [self._output(req, *new[req]) for req in reqs]

    def _sample(self, logits: torch.Tensor, inp: ModelInput, in_flight: InFlightTokens | None,
                requests: list[Request] | None = None) -> SamplerOutput:
        """The step's rows (or these requests' rows of `logits`) sampled: by the decode
        graphs' sampler where it takes them, else by the fused sampler's launches."""
        cols = self.sampler.columns(inp.sampling_requests if requests is None else requests,
                                    logits.shape[-1], in_flight)
        if requests is None and (out := self.runner.sample_in_graphs(inp, cols)) is not None:
            return out
        return self.sampler.run(logits, cols)

    def _land(self, step: InFlight | None) -> list[RequestOutput]:
        """Read an earlier step's tokens (waiting for its sampler, not for what was queued
        after it) and take them: a request that ended meanwhile drops its token."""
        if step is None:
            return []
        out = self.sampler.wait(step.copy)
        now, finished, sampled = time.monotonic(), {}, []
        for req, token, lp in zip(step.requests, out.token_ids,
                                  to_token_logprobs(out, step.requests)):
            req.num_in_flight -= 1
            if req.is_finished:
                continue
            sampled.append((req, token, lp))
            if (status := self._take(req, token, now)) is not None:
                finished[req] = status
        self._finish(finished)
        return [self._output(req, [token], [lp]) for req, token, lp in sampled]

    def _finish(self, finished: dict[Request, RequestStatus]) -> None:
        for req, status in finished.items():
            self.scheduler.finish(req, status)
            self.requests.pop(req.request_id, None)
            self.reply_tails.record(req)

    # --- speculative decoding ---

    def _draft(self) -> None:
        """Drafts for the running requests caught up with their tokens, each as long as its
        pace, its max_tokens, the context and its chunk allow: all of them functions of the
        request alone, so a seeded reply does not depend on its batch. The load decides only
        for requests whose replies drafting cannot change (past draft_batch_limit running
        requests, they do not draft)."""
        chunk, k_max = self.config.prefill_chunk_len, self.config.speculative.num_speculative_tokens
        limit = self.config.draft_batch_limit
        busy = limit and len(self.scheduler.running) > limit
        asking, lengths = [], []
        for req in self.scheduler.running:
            if req.spec_token_ids or not req.output_token_ids \
                    or req.num_computed_tokens != req.num_tokens - 1:
                continue
            if busy and req.drafts_change_nothing:
                continue  # a step bound by compute: its drafts would save no work
            if req.draft_pace is None:
                req.draft_pace = DraftPace(k_max)
            if req.draft_pace.position == req.num_tokens:
                continue  # asked at this position already (its step was put off)
            req.draft_pace.position = req.num_tokens
            boundary = ((req.num_tokens - 1) // chunk + 1) * chunk
            k = min(req.draft_pace.next_length(), req.max_tokens - req.num_output_tokens - 1,
                    self.config.ctx_len - req.num_tokens - 1, boundary - req.num_tokens)
            if k > 0:
                asking.append(req)
                lengths.append(k)
        for req, draft in zip(asking, self.drafter.propose(asking, lengths)):
            req.spec_token_ids = draft

    def _check_drafts(self, logits, inp, finished, now
                      ) -> tuple[dict[Request, tuple[list, list]], dict[str, int]]:
        """Keep each draft that equals the model's own choice at its position (and that the
        grammar allows, and that is no stop token before min_tokens), in order, up to the
        first that does not. Returns per drafted request the tokens kept and their logprobs,
        and per request id the drafts found wrong."""
        starts = np.cumsum([0, *inp.num_logits_rows[:-1]]).tolist()
        drafted = [(req, start) for req, start, n in
                   zip(inp.sampling_requests, starts, inp.num_logits_rows) if n > 1]
        rows = [start + i for req, start in drafted for i in range(len(req.spec_token_ids))]
        choices = iter(raw_choices(logits, rows, [req for req, _ in drafted
                                                  for _ in req.spec_token_ids]))
        new, rejected = {}, {}
        for req, start in drafted:
            drafts, tokens = req.spec_token_ids, []
            mine = [next(choices) for _ in drafts]
            for draft, choice in zip(drafts, mine):
                if draft != choice or (draft in req.stop_token_ids and req.grammar is None
                                       and req.num_output_tokens < req.options.min_tokens):
                    break
                if req.grammar is not None and not req.grammar.accept(draft):
                    break
                tokens.append(draft)
                status = self._take(req, draft, now, drafted=True)
                if status is not None:
                    finished[req] = status
                    break
            kept = len(tokens)
            req.draft_pace.record(len(drafts), kept)
            req.num_drafted_tokens += len(drafts)
            req.num_accepted_tokens += kept
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += kept
            rejected[req.request_id] = len(drafts) - kept
            req.spec_token_ids = []
            if kept and req.options.logprobs is not None:
                new[req] = (tokens, self.sampler.draft_logprobs(
                    logits, list(range(start, start + kept)), tokens, req.options.logprobs))
            else:
                new[req] = (tokens, [None] * kept)
        return new, rejected

    def _take(self, req: Request, token: int, now: float, drafted: bool = False
              ) -> RequestStatus | None:
        """Append one new token (sampled, or drafted and kept: its grammar step is taken
        already); the status it finishes the request with, if it does."""
        accepted, dictated = True, drafted
        if req.grammar is not None and not drafted:
            dictated = req.grammar.dictates(token)
            accepted = req.grammar.accept(token)
        req.append_output_token(token, dictated)
        stopped = req.stop_strings is not None and req.stop_strings.feed(token)
        if req.first_token_time is None:
            req.first_token_time = now
        if not accepted:
            # The mask makes this impossible; finish rather than emit invalid output.
            log.warning("[kiln]  Request %s sampled token %d outside its grammar",
                        req.request_id, token)
            return RequestStatus.FINISHED_STOPPED
        if token in req.stop_token_ids and not (req.options.ignore_eos and req.grammar is None):
            return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and req.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED
        if stopped:  # a stop string: ends in this step, not after the API's abort
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= req.max_tokens \
                or len(req.all_token_ids) >= self.config.ctx_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, req: Request, tokens: list[int], logprobs: list) -> RequestOutput:
        """Read for every row of every step: attributes, not the request's properties."""
        num_output, status, options = len(req.output_token_ids), req.status, req.options
        first = num_output == len(tokens)  # the request's first output
        return RequestOutput(
            req.request_id, tokens, logprobs if options.logprobs is not None else None,
            status.is_finished, status.finish_reason, len(req.prompt_token_ids),
            max(req.num_cached_tokens, 0), num_output, req.first_token_time, req.arrival_time,
            req.prompt_logprob_entries if first and options.prompt_logprobs is not None
            else None, req.num_accepted_tokens,
            req.num_drafted_tokens - req.num_accepted_tokens)

    def reset_prefix_cache(self) -> bool:
        return self.kv.block_pool.reset_prefix_cache()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            kv_total_blocks=self.config.num_blocks,
            kv_free_blocks=self.kv.block_pool.get_num_free_blocks(),
            prefix_queried_tokens=s.prefix_queried_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens, num_preemptions=s.num_preemptions,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens)


def _unfinished(scheduled: list[tuple[Request, int]], landed: list[RequestOutput]
                ) -> list[tuple[Request, int]]:
    """The scheduled rows of requests that the tokens just read did not end (whose blocks
    are gone): all of them in most steps, without a look at each."""
    if not any(o.finished for o in landed):
        return scheduled
    return [(req, n) for req, n in scheduled if not req.is_finished]
