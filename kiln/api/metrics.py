"""`GET /metrics`: Prometheus text through prometheus-client, in a registry of the server's
own (not the process-wide one), with vLLM's names under kiln's prefix (`kiln:`).

Per request (recorded when a generation ends, from its usage numbers): prompt and generation
tokens, finished requests by finish reason, time to first token, time per output token and
end-to-end latency. Per HTTP response: counts by route, method and status. The engine's
gauges and counters (running and waiting requests, KV blocks, prefix-cache tokens,
preemptions) are read from `EngineStats` at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kiln.api.pipeline.assembler import Totals
from kiln.runtime.engine.stats import EngineStats, RoutingStats

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

# vLLM's buckets, so its dashboards read kiln's histograms alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class RetiredCounts:
    """What the engines replaced by a model switch had counted: the counters go on from
    there instead of falling back to zero with each new engine."""

    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class EngineCollector:
    """The engine's numbers, read when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], EngineStats | None], retired: RetiredCounts):
        self.stats, self.retired = stats, retired

    def collect(self) -> Iterable[Metric]:
        s = self.stats() or EngineStats(0, 0, 0, 0, 0, 0, 0)
        r = self.retired
        yield GaugeMetricFamily("kiln:num_requests_running",
                                "Requests in the running batch.", value=s.num_running)
        yield GaugeMetricFamily("kiln:num_requests_waiting",
                                "Requests waiting to be scheduled.", value=s.num_waiting)
        yield GaugeMetricFamily("kiln:kv_blocks_used", "KV cache blocks held by requests.",
                                value=s.kv_used_blocks)
        yield GaugeMetricFamily("kiln:kv_blocks_free", "KV cache blocks no request holds "
                                "(prefix-cached ones included).", value=s.kv_free_blocks)
        yield GaugeMetricFamily("kiln:kv_blocks_total", "KV cache blocks in the pool.",
                                value=s.kv_total_blocks)
        yield CounterMetricFamily("kiln:prefix_cache_queries", "Prompt tokens looked up in "
                                  "the prefix cache.",
                                  value=r.prefix_queried_tokens + s.prefix_queried_tokens)
        yield CounterMetricFamily("kiln:prefix_cache_hits", "Prompt tokens found in the "
                                  "prefix cache.", value=r.prefix_hit_tokens + s.prefix_hit_tokens)
        yield CounterMetricFamily("kiln:num_preemptions", "Requests preempted to free KV "
                                  "blocks.", value=r.num_preemptions + s.num_preemptions)
        yield CounterMetricFamily("kiln:spec_decode_num_draft_tokens", "Drafted tokens "
                                  "checked (--speculative).",
                                  value=r.num_draft_tokens + s.num_draft_tokens)
        yield CounterMetricFamily("kiln:spec_decode_num_accepted_tokens", "Drafted tokens "
                                  "the model agreed with.",
                                  value=r.num_accepted_tokens + s.num_accepted_tokens)


class RoutingCollector:
    """`kiln serve --replicas`: how often a request went to a replica that held part of its
    prompt (kiln.cluster's RoutingStats, read when Prometheus scrapes; nothing otherwise)."""

    def __init__(self, routing: Callable[[], RoutingStats | None]):
        self.routing = routing

    def collect(self) -> Iterable[Metric]:
        r = self.routing()
        if r is None:
            return
        yield CounterMetricFamily("kiln:cluster_requests_routed", "Requests routed to a "
                                  "replica.", value=r.requests_routed)
        yield CounterMetricFamily("kiln:cluster_prefix_hits", "Requests routed to a replica "
                                  "that held a prefix of their prompt.", value=r.prefix_hits)
        yield CounterMetricFamily("kiln:cluster_prefix_hit_tokens", "Prompt tokens read from "
                                  "the chosen replicas' prefix caches.", value=r.hit_tokens)
        yield CounterMetricFamily("kiln:cluster_prompt_tokens", "Prompt tokens of routed "
                                  "requests.", value=r.prompt_tokens)
        by_replica = CounterMetricFamily("kiln:cluster_replica_requests", "Requests each "
                                         "replica took.", labels=["replica"])
        for replica, n in sorted(r.by_replica.items()):
            by_replica.add_metric([replica], n)
        yield by_replica


class Metrics:
    def __init__(self, engine_stats: Callable[[], EngineStats | None],
                 routing_stats: Callable[[], RoutingStats | None] = lambda: None):
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self.http_requests = Counter("kiln:http_requests", "HTTP responses by route, method "
                                     "and status code.", ["route", "method", "status"],
                                     registry=reg)
        self.prompt_tokens = Counter("kiln:prompt_tokens", "Prompt tokens of finished "
                                     "requests (prefix-cached ones included).", registry=reg)
        self.generation_tokens = Counter("kiln:generation_tokens", "Tokens generated.",
                                         registry=reg)
        self.request_success = Counter("kiln:request_success", "Finished requests by finish "
                                       "reason.", ["finished_reason"], registry=reg)
        self.ttft = Histogram("kiln:time_to_first_token_seconds", "Time to the first token.",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram("kiln:time_per_output_token_seconds", "Mean time between a "
                              "request's output tokens after the first.",
                              buckets=TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram("kiln:e2e_request_latency_seconds", "Time from a request's "
                             "arrival at the engine to its last token.", buckets=E2E_BUCKETS,
                             registry=reg)
        self.retired = RetiredCounts()
        reg.register(EngineCollector(engine_stats, self.retired))
        reg.register(RoutingCollector(routing_stats))

    def request_finished(self, t: Totals, finish_reason: str) -> None:
        """One generation has ended (finished, stopped, or its client gone)."""
        self.prompt_tokens.inc(t.prompt_tokens)
        self.generation_tokens.inc(t.completion_tokens)
        self.request_success.labels(finish_reason).inc()
        if not t.arrival_time:  # no output ever came back: nothing to time
            return
        end = t.finish_time or time.monotonic()
        self.e2e.observe(max(end - t.arrival_time, 0.0))
        if t.first_token_time is not None:
            self.ttft.observe(max(t.first_token_time - t.arrival_time, 0.0))
            if t.completion_tokens > 1:
                self.tpot.observe(max(end - t.first_token_time, 0.0)
                                  / (t.completion_tokens - 1))

    def http_response(self, route: str, method: str, status: int) -> None:
        self.http_requests.labels(route, method, str(status)).inc()

    def engine_retired(self, s: EngineStats) -> None:
        """A model switch is about to stop the engine that counted `s`."""
        r = self.retired
        r.prefix_queried_tokens += s.prefix_queried_tokens
        r.prefix_hit_tokens += s.prefix_hit_tokens
        r.num_preemptions += s.num_preemptions
        r.num_draft_tokens += s.num_draft_tokens
        r.num_accepted_tokens += s.num_accepted_tokens

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
