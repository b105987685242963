"""What crosses between the ingress and a replica: a request (EngineCall), its outputs
(ReplicaChunk) and a replica's report of itself (ReplicaReport). Plain dataclasses, pickled by
Ray; nothing here holds a process-local object (a grammar travels as its spec)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.engine_request import EngineRequest
from kiln.runtime.engine.request import RequestOutput
from kiln.runtime.engine.stats import EngineStats


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One request as the ingress admitted it (its sampling values are the sticky settings'
    snapshot, so a replica decides none of them), with what the router ranks replicas by."""

    request_id: str
    request: EngineRequest
    block_hashes: list[int]  # the prompt's full blocks (prefix_index.py)


@dataclass(frozen=True, slots=True)
class ReplicaChunk:
    """One message of a request's stream: the outputs the replica had ready, and who it is."""

    replica_id: str
    outputs: list[RequestOutput]


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """A replica's identity and gauges, for /health and the cluster's stats."""

    replica_id: str
    pid: int
    node_ip: str
    model: str
    config: EngineConfig
    stats: EngineStats
    requests: int  # requests it has taken since it started

    def to_json(self) -> dict:
        s = self.stats
        return {"replica": self.replica_id, "pid": self.pid, "node": self.node_ip,
                "model": self.model, "requests": self.requests, "running": s.num_running,
                "waiting": s.num_waiting, "kv_free_blocks": s.kv_free_blocks,
                "kv_total_blocks": s.kv_total_blocks,
                "prefix_queried_tokens": s.prefix_queried_tokens,
                "prefix_hit_tokens": s.prefix_hit_tokens}
