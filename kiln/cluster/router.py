"""Ray Serve's request router for kiln replicas: prefix affinity, then the least loaded.

Serve builds it in the ingress process (the one holding the deployment's handle), keeps its
replica set current (a replica that dies is dropped at once, its replacement added when it
is up) and retries a request whose replica died before taking it on another. This class only
ranks the live replicas for each request (prefix_index.rank_replicas) and keeps the picture
of their caches and loads it ranks by.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kiln.cluster.messages import EngineCall
from kiln.cluster.prefix_index import Candidate, PrefixIndex, rank_replicas


class PrefixAwareRouter(RequestRouter):
    """No FIFO mixin: a routing task fulfils the very request it ranked replicas for."""

    def initialize_state(self, capacity_blocks: int = 1 << 16, imbalance: int = 4,
                         min_match: float = 0.5) -> None:
        """capacity_blocks: a replica's KV pool in blocks (what its cache can hold);
        imbalance: how many more requests than the least loaded replica a prefix match may
        send to its replica before load wins; min_match: the part of a prompt's blocks a
        match must cover to count (prefix_index.rank_replicas)."""
        self.index = PrefixIndex(capacity_blocks)
        self.imbalance, self.min_match = imbalance, min_match
        self.loads: dict[ReplicaID, int] = {}
        self.placed: dict[str, ReplicaID] = {}  # internal request id -> its replica

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        hashes = _block_hashes(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        candidates = [Candidate(rid, self.index.matched_blocks(rid, hashes),
                                self.loads.get(rid, 0), len(self.index.of(rid)))
                      for rid in by_id]
        ranks = rank_replicas(candidates, len(hashes), self.imbalance, self.min_match)
        if ranks:
            # Placed now, not once the replica has taken it: the requests routed meanwhile
            # (a burst is ranked before any is sent) must see this one's load and prefix.
            self._place(pending_request, ranks[0][0])
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        """Taken: by the replica it was placed on, unless that one failed it meanwhile."""
        if self.placed.get(pending_request.metadata.internal_request_id) != replica_id:
            self._place(pending_request, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._unplace(internal_request_id)

    def _place(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        request_id = pending_request.metadata.internal_request_id
        self._unplace(request_id)  # a retry: its first replica did not take it
        self.placed[request_id] = replica_id
        self.loads[replica_id] = self.loads.get(replica_id, 0) + 1
        self.index.record(replica_id, _block_hashes(pending_request))

    def _unplace(self, request_id: str) -> None:
        replica_id = self.placed.pop(request_id, None)
        if replica_id in self.loads:
            self.loads[replica_id] = max(0, self.loads[replica_id] - 1)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._forget_gone()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_gone()

    def _forget_gone(self) -> None:
        live = set(self._replica_id_set)
        self.index.keep_only(live)
        self.loads = {rid: n for rid, n in self.loads.items() if rid in live}


def _block_hashes(pending_request: PendingRequest | None) -> list[int]:
    call = pending_request.args[0] if pending_request is not None and pending_request.args \
        else None
    return call.block_hashes if isinstance(call, EngineCall) else []
