"""The one interface the API holds an engine by, whichever engine it is: the local engine on its
thread (async_engine.AsyncEngine) or Ray Serve replicas behind one ingress
(kiln.cluster.engine.ClusterEngine). Checked by tests/test_engine_client.py for both."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.engine_request import EngineRequest
from kiln.runtime.engine.request import RequestOutput
from kiln.runtime.engine.stats import EngineStats, RoutingStats
from kiln.runtime.sampling.grammar import GrammarSpec


@runtime_checkable
class RequestStream(Protocol):
    """One request's outputs as the engine makes them, the last with `finished`; leaving the
    iteration early aborts the request. A failure on the engine's side (a replica lost) ends
    it with RequestFailedError."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...


@runtime_checkable
class EngineClient(Protocol):
    @property
    def config(self) -> EngineConfig:
        """How the engine runs the model (context, KV pool, device)."""

    async def check_grammar(self, spec: GrammarSpec, prefix: str = "") -> None:
        """Raise the 400 a request with this grammar would meet, before it is admitted."""

    async def add_request(self, request_id: str, request: EngineRequest) -> RequestStream:
        """Validate (raising before any output) and start the request."""

    def abort(self, request_id: str, reason: str = "client gone") -> None:
        """End a request now; its stream ends with finish_reason "abort"."""

    def abort_all(self, reason: str) -> None: ...

    def stats(self) -> EngineStats:
        """Gauges and counters (a cluster's summed over its replicas)."""

    def routing_stats(self) -> RoutingStats | None:
        """How requests were spread over replicas; None for one engine."""

    def health(self) -> dict:
        """The engine's own part of /health (a cluster's replicas); {} for one engine."""

    def shutdown(self) -> None: ...
