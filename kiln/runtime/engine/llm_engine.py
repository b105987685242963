"""The engine: requests in, one batched step at a time, outputs out.

`LLMEngine` is the synchronous core (add_request / abort / step). `AsyncEngine` runs it on
a thread of its own and gives each request an async stream of outputs; requests and aborts
reach the thread through an inbox that is drained between steps.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kiln.kernels.warmup import KernelShapes, warmup_launches
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.model_runner import ModelRunner
from kiln.runtime.engine.request import Request, RequestOutput, RequestStatus
from kiln.runtime.engine.scheduler import Scheduler
from kiln.runtime.errors import ContextLengthError, InvalidRequestError, KVCacheCapacityError
from kiln.runtime.kv.kv_cache_manager import KVCacheManager
from kiln.runtime.models.loader import LoadedModel
from kiln.runtime.sampling.grammar import GrammarCompilerCache, GrammarState
from kiln.runtime.sampling.params import SamplingParams
from kiln.runtime.sampling.sampler import Sampler, fetch_samples, to_token_logprobs
from kiln.runtime.text.stop_strings import StopStringChecker

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger("kiln")


class ReplyTails:
    """The token sequences (prompt + reply) of recently finished requests, so that a request
    continuing one of them while its blocks are still cached starts its penalty window with
    the end of that reply (contract: "Penalty window and conversations held in the cache")."""

    def __init__(self, block_size: int, capacity: int = 256):
        self.block_size, self.capacity = block_size, capacity
        self.entries: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()

    def record(self, req: Request) -> None:
        key = tuple(req.all_token_ids)
        self.entries[key] = list(req.window_token_ids)
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def lookup(self, prompt: list[int], num_cached_tokens: int) -> list[int]:
        best: list[int] = []
        best_len = 0
        for seq, reply in self.entries.items():
            n = len(seq)
            # Its last token was sampled, never computed: its full blocks end before it.
            full = (n - 1) // self.block_size * self.block_size
            if best_len < n < len(prompt) and num_cached_tokens >= full \
                    and tuple(prompt[:n]) == seq:
                best, best_len = reply, n
        return best


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters (for /metrics and /health)."""

    num_running: int
    num_waiting: int
    kv_total_blocks: int
    kv_free_blocks: int  # cached blocks no request holds count as free
    prefix_queried_tokens: int  # counters since start
    prefix_hit_tokens: int
    num_preemptions: int

    @property
    def kv_used_blocks(self) -> int:
        return self.kv_total_blocks - self.kv_free_blocks


def check_context(config: EngineConfig, num_prompt_tokens: int, max_tokens: int | None) -> None:
    """The context first (the contract's error), then the KV pool: a request must fit in
    the whole pool alone, or it could never run. (A function of the config alone, so an
    ingress without an engine, kiln.cluster's, checks exactly as the engine does.)"""
    ctx, kv_tokens = config.ctx_len, config.num_blocks * config.block_size
    if num_prompt_tokens >= ctx or (max_tokens is not None
                                    and num_prompt_tokens + max_tokens > ctx):
        raise ContextLengthError(num_prompt_tokens=num_prompt_tokens,
                                 max_tokens=max_tokens, ctx_len=ctx)
    if num_prompt_tokens + (max_tokens or 1) > kv_tokens:
        raise KVCacheCapacityError(num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens,
                                   kv_cache_tokens=kv_tokens)


def check_logit_bias(logit_bias, vocab_size: int) -> None:
    """A bias on a token the model does not have is a 400 (the API cannot know the size)."""
    bad = [t for t, _ in logit_bias if t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"Invalid 'logit_bias': token id {bad[0]} is outside the "
                                  f"vocabulary (size {vocab_size}).", param="logit_bias",
                                  code="invalid_value")


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
        if config.use_triton and self.runner.device.type == "cuda":
            self._prepare_gpu()

    def _prepare_gpu(self) -> None:
        """At load, not mid-reply: compile every kernel variant this model's steps launch (a
        variant first met by a step would stall every stream for its compile, 0.5-5 s),
        then capture the decode graphs."""
        t0 = time.perf_counter()
        model = self.loaded.model
        launches = warmup_launches(KernelShapes.of(self.loaded.config), model.backend.dtype,
                                   model.logits_dtype, self.runner.device)
        for _, launch in launches:
            launch()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        log.info("[kiln]  Compiled %d kernel variants in %.1f s", len(launches), t1 - t0)
        if self.runner.graphs is not None:
            self.runner.graphs.capture()
            log.info("[kiln]  Captured decode CUDA graphs for batch sizes %s in %.1f s",
                     ",".join(map(str, self.runner.graphs.sizes)), time.perf_counter() - t1)

    @property
    def kv_cache_tokens(self) -> int:
        return self.config.num_blocks * self.config.block_size

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        check_context(self.config, num_prompt_tokens, max_tokens)

    def make_request(self, request_id: str, prompt_token_ids: list[int],
                     sampling: SamplingParams, max_tokens: int | None = None,
                     stop_token_ids: frozenset[int] | None = None,
                     num_top_logprobs: int | None = None, ignore_eos: bool = False,
                     grammar: xgr.CompiledGrammar | None = None,
                     grammar_prefix: str = "", stop: list[str] | None = None,
                     logit_bias: tuple[tuple[int, float], ...] = (), min_tokens: int = 0,
                     prompt_logprobs: int | None = None,
                     prefill_leader: str | None = None) -> Request:
        """Validate against the context and the KV pool; the prompt is never truncated. A
        reply without max_tokens ends ("length") where the context or the pool is full."""
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        self.check_context(len(prompt_token_ids), max_tokens)
        check_logit_bias(logit_bias, self.loaded.config.vocab_size)
        room = min(self.config.ctx_len, self.kv_cache_tokens) - len(prompt_token_ids)
        state = GrammarState(grammar, grammar_prefix, self.grammars.token_bytes) \
            if grammar is not None else None
        return Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling=sampling,
            max_tokens=min(max_tokens, room) if max_tokens is not None else room,
            stop_token_ids=stop_token_ids if stop_token_ids is not None
            else self.loaded.tokenizer.stop_token_ids,
            num_top_logprobs=num_top_logprobs, ignore_eos=ignore_eos and state is None,
            logit_bias=tuple(logit_bias), min_tokens=min_tokens,
            prompt_logprobs=prompt_logprobs,
            prompt_logprob_entries=[None] if prompt_logprobs is not None else [],
            prefill_leader_id=prefill_leader,
            grammar=state, stop_strings=StopStringChecker(self.loaded.tokenizer, stop)
            if any(stop or ()) else None)

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
        sched = self.scheduler.schedule()
        # Nothing schedulable although requests wait: only an add or abort can change that.
        self.stalled = not sched.scheduled
        if not sched.scheduled:
            return []
        for req, _ in sched.scheduled:
            if req.num_computed_tokens == req.num_cached_tokens and not req.output_token_ids \
                    and req.sampling.seed is None and req.sampling.has_penalties:
                req.window_prefix = self.reply_tails.lookup(req.prompt_token_ids,
                                                            req.num_cached_tokens)
        inp = self.runner.prepare(sched.scheduled)
        logits = self.runner.execute(inp)
        self.scheduler.update_after_step(sched.scheduled)
        if logits is None:
            return []
        reqs = inp.sampling_requests
        out = fetch_samples(self.sampler(logits, reqs))  # the step's one device sync
        logprobs = to_token_logprobs(out, reqs)
        now = time.monotonic()
        outputs = []
        for req, token, lp in zip(reqs, out.token_ids, logprobs):
            accepted, dictated = True, False
            if req.grammar is not None:
                dictated = req.grammar.dictates(token)
                accepted = req.grammar.accept(token)
            req.append_output_token(token, dictated=dictated)
            stopped = req.stop_strings is not None and req.stop_strings.feed(token)
            if req.first_token_time is None:
                req.first_token_time = now
            status = None
            if not accepted:
                # The mask makes this impossible; finish rather than emit invalid output.
                log.warning("[kiln]  Request %s sampled token %d outside its grammar",
                            req.request_id, token)
                status = RequestStatus.FINISHED_STOPPED
            elif token in req.stop_token_ids and not req.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif req.grammar is not None and req.grammar.is_terminated():
                status = RequestStatus.FINISHED_STOPPED
            elif stopped:  # a stop string: ends in this step, not after the API's abort
                status = RequestStatus.FINISHED_STOPPED
            elif req.num_output_tokens >= req.max_tokens \
                    or req.num_tokens >= self.config.ctx_len:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self.scheduler.finish(req, status)
                self.requests.pop(req.request_id, None)
                self.reply_tails.record(req)
            outputs.append(self._output(req, [token], [lp] if lp is not None else None))
        return outputs

    def _output(self, req: Request, tokens: list[int], logprobs) -> RequestOutput:
        first = req.num_output_tokens == len(tokens)  # the request's first output
        return RequestOutput(
            request_id=req.request_id, new_token_ids=tokens, new_logprobs=logprobs,
            finished=req.is_finished, finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens,
            first_token_time=req.first_token_time, arrival_time=req.arrival_time,
            prompt_logprobs=req.prompt_logprob_entries
            if first and req.prompt_logprobs is not None else None)

    def reset_prefix_cache(self) -> bool:
        return self.kv.block_pool.reset_prefix_cache()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            kv_total_blocks=self.config.num_blocks,
            kv_free_blocks=self.kv.block_pool.get_num_free_blocks(),
            prefix_queried_tokens=s.prefix_queried_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens, num_preemptions=s.num_preemptions)


class RequestStream:
    """One request's outputs, as an async iterator; leaving it early aborts the request."""

    def __init__(self, engine: AsyncEngine, request: Request):
        self.engine, self.request = engine, request
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.finished = False

    def put(self, output: RequestOutput) -> None:  # called from the engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, output)
        except RuntimeError:  # the server's loop is closed: no one is reading any more
            pass

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                out = await self.queue.get()
                yield out
                if out.finished:
                    self.finished = True
                    return
        finally:
            if not self.finished:
                self.engine.abort(self.request.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self._thread.start()

    def next_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    # What the API asks of the engine besides requests: both are read-only and thread-safe.

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Raises ContextLengthError if the prompt (with max_tokens) cannot fit."""
        self.engine.check_context(num_prompt_tokens, max_tokens)

    def kv_blocks(self) -> tuple[int, int]:
        """(free, total) KV blocks; free counts cached blocks no request holds (a read of
        two ints, fine from any thread)."""
        pool = self.engine.kv.block_pool
        return pool.get_num_free_blocks(), self.engine.config.num_blocks

    def stats(self) -> EngineStats:
        """Gauges and counters; reads of ints the engine thread writes, fine from any
        thread (a snapshot may be a step old)."""
        return self.engine.stats()

    def compile_grammar(self, spec):
        """The compiled grammar of a GrammarSpec (cached); blocking, so call it off the loop."""
        return self.engine.grammars.get(spec)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling: SamplingParams, **kw) -> RequestStream:
        """Validates now (raising before any stream starts) and returns the output stream."""
        req = self.engine.make_request(request_id, prompt_token_ids, sampling, **kw)
        stream = RequestStream(self, req)
        self.streams[request_id] = stream
        self.inbox.put(("add", req))
        return stream

    def abort(self, request_id: str, reason: str = "client gone") -> None:
        self.inbox.put(("abort", (request_id, reason)))

    def abort_all(self, reason: str) -> None:
        for request_id in list(self.streams):
            self.abort(request_id, reason)

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, arg = self.inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self.engine.add_request(arg)
            elif kind == "abort":
                request_id, reason = arg
                out = self.engine.abort(request_id)
                stream = self.streams.pop(request_id, None)
                if out is not None:
                    log.info("[kiln]  Aborted request %s (%s) after %d tokens",
                             request_id, reason, out.num_output_tokens)
                    if stream is not None:
                        stream.put(out)
            elif kind == "call":
                arg()

    def _loop(self) -> None:
        while not self._stop:
            # Wait for the inbox when there is nothing to step, or nothing the scheduler
            # can place: stepping again would spin on the same answer.
            self._drain_inbox(block=not self.engine.has_unfinished() or self.engine.stalled)
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception:
                log.exception("[kiln]  Engine step failed; aborting the running requests")
                outputs = [o for r in list(self.engine.requests)
                           if (o := self.engine.abort(r)) is not None]
            for out in outputs:
                stream = self.streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
                    if out.finished:
                        self.streams.pop(out.request_id, None)

    def shutdown(self) -> None:
        self._stop = True
        self.inbox.put(("noop", None))
        self._thread.join(timeout=5)
