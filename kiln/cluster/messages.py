"""What crosses between the ingress and a replica: a request (EngineCall), its outputs
(ReplicaChunk) and a replica's report of itself (ReplicaReport). Plain dataclasses, pickled by
Ray; nothing here holds a process-local object (a compiled grammar travels as its spec)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.llm_engine import EngineStats
from kiln.runtime.engine.request import RequestOutput
from kiln.runtime.sampling.grammar import GrammarSpec
from kiln.runtime.sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One request, fully resolved by the ingress: the sampling values are the sticky
    settings' snapshot, so a replica never decides any of them."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_hashes: list[int]  # the prompt's full blocks, for the router (prefix_index.py)
    max_tokens: int | None = None
    stop_token_ids: frozenset[int] | None = None
    num_top_logprobs: int | None = None
    ignore_eos: bool = False
    grammar: GrammarSpec | None = None  # compiled on the replica (its own cache)
    grammar_prefix: str = ""
    stop: list[str] | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    # n > 1: choice 0's request id. The router sends the same prompt to the same replica,
    # where the sibling shares its prefill if it arrives after it (else it reads it itself).
    prefill_leader: str | None = None


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
