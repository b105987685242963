"""One engine replica: a Ray Serve replica process holding its own LLMEngine, KV cache and
engine thread, built by kiln's own bootstrap. The ingress streams each request's outputs
from `generate`; leaving the stream early (an abort, a client gone) cancels it here, which
aborts the request in the engine and frees its KV blocks."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import replace

from kiln.cluster.messages import EngineCall, ReplicaChunk, ReplicaReport
from kiln.runtime.engine.bootstrap import EngineOptions, start_engine

log = logging.getLogger("kiln")


def _log_to_stderr() -> None:
    """kiln's log lines, as `kiln serve` writes them (Ray prints a replica's stderr on the
    driver's, prefixed with the replica)."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


class KilnReplica:
    """The Serve deployment's class (launch.py wraps it with serve.deployment)."""

    def __init__(self, model: str, options: EngineOptions):
        import ray
        from ray import serve

        _log_to_stderr()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_ip = ray.util.get_node_ip_address()
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
        if options.threads is None and cpus:
            # The CPUs Ray gave this replica, not the machine's: replicas sharing a machine
            # would otherwise each spin a thread per core.
            options = replace(options, threads=max(1, int(cpus)))
        self.model = model
        _, self.engine = start_engine(model, options)
        self.requests = 0
        log.info("[kiln]  Replica %s (pid %d) serving %s on %s threads", self.replica_id,
                 os.getpid(), model, options.threads or "all")

    async def generate(self, call: EngineCall) -> AsyncIterator[ReplicaChunk]:
        stream = await self.engine.add_request(call.request_id, call.request)
        self.requests += 1
        async for out in stream:  # a cancel from the ingress leaves here: the stream aborts
            yield ReplicaChunk(self.replica_id, [out])

    def report(self) -> ReplicaReport:
        return ReplicaReport(replica_id=self.replica_id, pid=os.getpid(), node_ip=self.node_ip,
                             model=self.model, config=self.engine.config,
                             stats=self.engine.stats(), requests=self.requests)

    def check_health(self) -> None:
        """Serve's periodic probe: a replica whose engine thread died is replaced."""
        if not self.engine.is_alive():
            raise RuntimeError("the engine thread has stopped")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
