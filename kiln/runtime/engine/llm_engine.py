"""The engine's synchronous core: requests in (`add_request`, `abort`), one batched step at a
time (`step`), outputs out. `AsyncEngine` (async_engine.py) runs it on a thread of its own."""

from __future__ import annotations

import logging
import time

import torch

from kiln.kernels.warmup import KernelShapes, warmup_launches
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.engine_request import EngineRequest, check_fits
from kiln.runtime.engine.model_runner import ModelRunner
from kiln.runtime.engine.reply_tails import ReplyTails
from kiln.runtime.engine.request import Request, RequestOutput, RequestStatus
from kiln.runtime.engine.scheduler import Scheduler
from kiln.runtime.engine.stats import EngineStats
from kiln.runtime.kv.kv_cache_manager import KVCacheManager
from kiln.runtime.models.loader import LoadedModel
from kiln.runtime.sampling.grammar import GrammarCompilerCache, GrammarState
from kiln.runtime.sampling.sampler import Sampler, fetch_samples, to_token_logprobs
from kiln.runtime.text.stop_strings import StopStringChecker

log = logging.getLogger("kiln")


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
        return Request(
            request_id=request_id, prompt_token_ids=prompt, sampling=request.sampling,
            max_tokens=min(options.max_tokens, room) if options.max_tokens is not None
            else room, options=options,
            stop_token_ids=options.stop_token_ids if options.stop_token_ids is not None
            else tokenizer.stop_token_ids,
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
            elif token in req.stop_token_ids \
                    and not (req.options.ignore_eos and req.grammar is None):
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
            if first and req.options.prompt_logprobs is not None else None)

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
