"""ClusterEngine: the API's EngineClient (runtime/engine/client.py), served by Ray Serve
replicas.

The ingress keeps everything that decides a request (validation, the sticky settings'
snapshot, grammar checks), so a replica only runs what it is sent and the cluster answers as
one server would. The replicas' gauges reach /health through a report each replica gives
every second (a broadcast from a thread of this process), so /health never waits on one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import replace

from kiln.cluster.messages import EngineCall, ReplicaReport
from kiln.cluster.prefix_index import prompt_block_hashes
from kiln.cluster.stream import ClusterStream
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.engine_request import EngineRequest, check_fits
from kiln.runtime.engine.request import RequestOutput
from kiln.runtime.engine.stats import EngineStats, RoutingStats
from kiln.runtime.models.loader import ModelInfo
from kiln.runtime.sampling.grammar import GrammarCompilerCache, GrammarSpec

log = logging.getLogger("kiln")

REPORT_PERIOD_S = 1.0


class ClusterEngine:
    def __init__(self, cluster, model: ModelInfo, reports: list[ReplicaReport]):
        """cluster: launch.Cluster (the deployment's handle; stops the cluster);
        reports: the replicas' first reports, which give the engine config they run."""
        self.cluster = cluster
        self.generate = cluster.handle.options(method_name="generate", stream=True)
        self.config: EngineConfig = reports[0].config
        self.model_id = f"{model.path.name}:{model.path.stat().st_size}"  # LLMEngine's
        self.vocab_size = model.config.vocab_size
        self.grammars = GrammarCompilerCache(model.tokenizer, vocab_size=self.vocab_size)
        self.streams: dict[str, ClusterStream] = {}
        self.routing = RoutingStats()
        self.reports = {r.replica_id: r for r in reports}
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, name="kiln-cluster-report",
                                          daemon=True)
        self._reporter.start()

    # --- what the API reads ---

    def stats(self) -> EngineStats:
        """The replicas' gauges and counters, summed (each as last reported)."""
        return EngineStats.total([r.stats for r in self.reports.values()])

    def routing_stats(self) -> RoutingStats:
        """Routing counters since start (a copy): requests routed, prefix hits, hit tokens."""
        return replace(self.routing, by_replica=dict(self.routing.by_replica))

    def health(self) -> dict:
        """/health's `cluster` block: each live replica as last reported, and the routing."""
        return {"cluster": {"replicas": [r.to_json() for r in self.reports.values()],
                            "routing": self.routing.to_json()}}

    # --- requests ---

    async def check_grammar(self, spec: GrammarSpec, prefix: str = "") -> None:
        """Compiled here too (a bad spec is a 400 before routing); each replica compiles its
        own from the spec (xgrammar's objects stay in their process)."""
        await asyncio.get_running_loop().run_in_executor(None, self.grammars.check, spec,
                                                         prefix)

    async def add_request(self, request_id: str, request: EngineRequest) -> ClusterStream:
        """Validates here, as the engine would (raising before any stream starts), then
        routes the request; returns its output stream."""
        prompt = request.prompt_token_ids
        check_fits(self.config, self.vocab_size, len(prompt), request.options)
        if request.grammar is not None:
            await self.check_grammar(request.grammar, request.grammar_prefix)
        call = EngineCall(request_id, request, prompt_block_hashes(
            prompt, self.config.block_size, self.model_id))
        stream = ClusterStream(request_id, len(prompt),
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
