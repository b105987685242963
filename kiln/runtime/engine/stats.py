"""What an engine reports of itself: its gauges and counters (/metrics, /health), and, for an
engine that spreads requests over replicas (kiln.cluster), how its routing went."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters."""

    num_running: int
    num_waiting: int
    kv_total_blocks: int
    kv_free_blocks: int  # cached blocks no request holds count as free
    prefix_queried_tokens: int  # counters since start
    prefix_hit_tokens: int
    num_preemptions: int
    num_draft_tokens: int = 0  # drafted tokens checked (speculative decoding)
    num_accepted_tokens: int = 0  # of them, kept

    @property
    def kv_used_blocks(self) -> int:
        return self.kv_total_blocks - self.kv_free_blocks

    @staticmethod
    def total(stats: list[EngineStats]) -> EngineStats:
        """Several engines' numbers as one engine's (a cluster's replicas)."""
        return EngineStats(*(sum(getattr(s, name) for s in stats)
                             for name in EngineStats.__slots__))


@dataclass
class RoutingStats:
    """Counters since start: how often the replica a request went to already held part of its
    prompt (for /metrics: kiln:cluster_requests_routed and so on)."""

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
