"""ClusterEngine: what the API asks of an AsyncEngine, served by Ray Serve replicas.

The ingress keeps everything that decides a request (validation, the sticky settings'
snapshot, grammar checks), so a replica only runs what it is sent and the cluster answers as
one server would. The replicas' gauges reach /health through a report each replica gives
every second (a broadcast from a thread of this process), so /health never waits on one.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field, replace

from kiln.cluster.messages import EngineCall, ReplicaReport
from kiln.cluster.prefix_index import prompt_block_hashes
from kiln.cluster.stream import ClusterStream
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.llm_engine import EngineStats, check_context, check_logit_bias
from kiln.runtime.engine.request import RequestOutput
from kiln.runtime.models.loader import LoadedModel
from kiln.runtime.sampling.grammar import GrammarCompilerCache, GrammarSpec, GrammarState
from kiln.runtime.sampling.params import SamplingParams

log = logging.getLogger("kiln")

REPORT_PERIOD_S = 1.0


@dataclass
class RoutingStats:
    """Counters since start: how often the replica a request went to already held part of
    its prompt (for /metrics: kiln_cluster_requests_routed_total and so on)."""

    requests_routed: int = 0
    prefix_hits: int = 0  # requests whose replica had a cached prefix of the prompt
    hit_tokens: int = 0  # prompt tokens read from the replicas' prefix caches
    prompt_tokens: int = 0
    by_replica: dict[str, int] = field(default_factory=dict)  # requests each replica took

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.requests_routed if self.requests_routed else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict:
        return {"requests_routed": self.requests_routed, "prefix_hits": self.prefix_hits,
                "hit_tokens": self.hit_tokens, "prompt_tokens": self.prompt_tokens,
                "hit_rate": round(self.hit_rate, 4),
                "token_hit_rate": round(self.token_hit_rate, 4),
                "by_replica": dict(self.by_replica)}


@dataclass(frozen=True, slots=True)
class CheckedGrammar:
    """A grammar compiled here (a bad spec is a 400 before routing) and sent as its spec:
    each replica compiles its own (xgrammar's objects stay in their process)."""

    spec: GrammarSpec
    compiled: object  # xgrammar.CompiledGrammar


class ClusterEngine:
    def __init__(self, cluster, loaded: LoadedModel, reports: list[ReplicaReport]):
        """cluster: launch.Cluster (the deployment's handle; stops the cluster);
        reports: the replicas' first reports, which give the engine config they run."""
        self.cluster = cluster
        self.generate = cluster.handle.options(method_name="generate", stream=True)
        self.config: EngineConfig = reports[0].config
        self.model_id = f"{loaded.path.name}:{loaded.path.stat().st_size}"  # LLMEngine's
        self.stop_token_ids = loaded.tokenizer.stop_token_ids
        self.vocab_size = loaded.config.vocab_size
        self.grammars = GrammarCompilerCache(loaded.tokenizer,
                                             vocab_size=loaded.config.vocab_size)
        self.streams: dict[str, ClusterStream] = {}
        self.routing = RoutingStats()
        self.reports = {r.replica_id: r for r in reports}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, name="kiln-cluster-report",
                                          daemon=True)
        self._reporter.start()

    def next_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    # --- what the API asks besides requests (AsyncEngine's methods) ---

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        check_context(self.config, num_prompt_tokens, max_tokens)

    def compile_grammar(self, spec: GrammarSpec) -> CheckedGrammar:
        return CheckedGrammar(spec, self.grammars.get(spec))

    def kv_blocks(self) -> tuple[int, int]:
        """(free, total) KV blocks over the live replicas, as last reported."""
        reports = list(self.reports.values())
        return (sum(r.stats.kv_free_blocks for r in reports),
                sum(r.stats.kv_total_blocks for r in reports))

    def stats(self) -> EngineStats:
        """The replicas' gauges and counters, summed (each as last reported)."""
        s = [r.stats for r in self.reports.values()]
        return EngineStats(
            num_running=sum(x.num_running for x in s), num_waiting=sum(x.num_waiting for x in s),
            kv_total_blocks=sum(x.kv_total_blocks for x in s),
            kv_free_blocks=sum(x.kv_free_blocks for x in s),
            prefix_queried_tokens=sum(x.prefix_queried_tokens for x in s),
            prefix_hit_tokens=sum(x.prefix_hit_tokens for x in s),
            num_preemptions=sum(x.num_preemptions for x in s))

    def routing_stats(self) -> RoutingStats:
        """Routing counters since start (a copy): requests routed, prefix hits, hit tokens."""
        return replace(self.routing, by_replica=dict(self.routing.by_replica))

    def cluster_health(self) -> dict:
        """/health's `cluster` block: each live replica as last reported, and the routing."""
        return {"replicas": [r.to_json() for r in self.reports.values()],
                "routing": self.routing.to_json()}

    # --- requests ---

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling: SamplingParams, *, max_tokens: int | None = None,
                    stop_token_ids: frozenset[int] | None = None,
                    num_top_logprobs: int | None = None, ignore_eos: bool = False,
                    grammar: CheckedGrammar | None = None, grammar_prefix: str = "",
                    stop: list[str] | None = None, logit_bias: tuple = (),
                    min_tokens: int = 0, prompt_logprobs: int | None = None,
                    prefill_leader: str | None = None) -> ClusterStream:
        """Validates here, as the engine would (raising before any stream starts), then
        routes the request; returns its output stream."""
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        self.check_context(len(prompt_token_ids), max_tokens)
        check_logit_bias(logit_bias, self.vocab_size)
        if grammar is not None and grammar_prefix:
            GrammarState(grammar.compiled, grammar_prefix)  # a prefix it rejects is a 400
        call = EngineCall(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling=sampling,
            block_hashes=prompt_block_hashes(prompt_token_ids, self.config.block_size,
                                             self.model_id),
            max_tokens=max_tokens, stop_token_ids=stop_token_ids,
            num_top_logprobs=num_top_logprobs, ignore_eos=ignore_eos,
            grammar=grammar.spec if grammar is not None else None,
            grammar_prefix=grammar_prefix, stop=stop, logit_bias=tuple(logit_bias),
            min_tokens=min_tokens, prompt_logprobs=prompt_logprobs,
            prefill_leader=prefill_leader)
        stream = ClusterStream(request_id, len(prompt_token_ids),
                               send=lambda: self.generate.remote(call),
                               on_first=self._routed, on_end=self._ended)
        self.streams[request_id] = stream
        return stream

    def _routed(self, replica_id: str, first: RequestOutput) -> None:
        r = self.routing
        r.requests_routed += 1
        r.prompt_tokens += first.num_prompt_tokens
        r.hit_tokens += first.num_cached_tokens
        r.prefix_hits += first.num_cached_tokens > 0
        r.by_replica[replica_id] = r.by_replica.get(replica_id, 0) + 1

    def _ended(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def abort(self, request_id: str, reason: str = "client gone") -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            log.info("[kiln]  Aborting request %s (%s)", request_id, reason)
            stream.abort()

    def abort_all(self, reason: str) -> None:
        for request_id in list(self.streams):
            self.abort(request_id, reason)

    # --- the replicas' reports ---

    def _report_loop(self) -> None:
        while not self._stop.wait(REPORT_PERIOD_S):
            self.refresh_reports()

    def refresh_reports(self, timeout_s: float = 5.0) -> None:
        """Ask every live replica for its report (blocking: not on the event loop)."""
        try:
            results = self.cluster.handle.broadcast("report").results(
                timeout_s=timeout_s, return_exceptions=True)
        except Exception as exc:  # the cluster is going away, or Serve is busy: next time
            log.debug("[kiln]  Replica reports failed: %r", exc)
            return
        reports = [r for r in results if isinstance(r, ReplicaReport)]
        if reports or not results:
            self.reports = {r.replica_id: r for r in reports}

    def shutdown(self) -> None:
        self._stop.set()
        self.abort_all("shutdown")
        self.cluster.release(self)
