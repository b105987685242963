"""Which replica holds which prompt prefix: the router's picture of the replicas' prefix
caches, and the choice it makes from it. Plain Python, no Ray: router.py feeds it.

A prompt is keyed as the KV cache keys it, one chained xxh64 per full block of 16 tokens
(`runtime.kv.block_pool.hash_block`), so "the longest cached prefix" is the longest run of
leading block keys a replica was last sent. Each replica's entry is an LRU of at most its KV
pool's block count, the bound its own cache evicts at; the picture is a guess (a replica may
evict earlier, under load), and a wrong guess only costs a prefill.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kiln.runtime.kv.block_pool import hash_block


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, model_id: str) -> list[int]:
    """The chained keys of the prompt's full blocks, as KVCacheManager computes them."""
    hashes: list[int] = []
    for i in range(len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size],
                                 model_id))
    return hashes


class ReplicaPrefixes:
    """One replica's cached block keys, least recently sent first."""

    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self.keys: OrderedDict[int, None] = OrderedDict()

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of the prompt held here (a chained key stands for its whole prefix,
        but a parent evicted before its child breaks the run, as it does in the cache)."""
        n = 0
        for h in hashes:
            if h not in self.keys:
                break
            n += 1
        return n

    def record(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.keys[h] = None
            self.keys.move_to_end(h)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A live replica as the router sees it when a request comes."""

    replica: Hashable
    matched_blocks: int
    load: int  # this ingress's requests on it, not yet finished
    cached_blocks: int  # how much its cache holds (for spreading new prefixes)


def rank_replicas(candidates: Sequence[Candidate], prompt_blocks: int, imbalance: int,
                  min_match: float = 0.5) -> list[list[Hashable]]:
    """The replicas in order of preference, best first (one per rank).

    The longest prefix match wins if it covers at least `min_match` of the prompt's full
    blocks and its replica has at most `imbalance` requests beyond the least loaded one;
    otherwise load decides. A prefix that every prompt shares (a chat template's system
    prompt) must not pull every new document onto one replica, nor every request onto one
    busy replica. Among equal matches the less loaded wins, then the emptier cache, so new
    prefixes spread over the replicas.
    """
    if not candidates:
        return []
    least = min(c.load for c in candidates)

    def affinity(c: Candidate) -> int:
        if c.load - least > imbalance or c.matched_blocks < min_match * prompt_blocks:
            return 0
        return c.matched_blocks

    return [[c.replica] for c in sorted(candidates,
                                        key=lambda c: (-affinity(c), c.load, c.cached_blocks))]


class PrefixIndex:
    """Every replica's ReplicaPrefixes; replicas come and go as Serve reports them."""

    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self.replicas: dict[Hashable, ReplicaPrefixes] = {}

    def of(self, replica: Hashable) -> ReplicaPrefixes:
        if replica not in self.replicas:
            self.replicas[replica] = ReplicaPrefixes(self.capacity)
        return self.replicas[replica]

    def matched_blocks(self, replica: Hashable, hashes: Sequence[int]) -> int:
        entry = self.replicas.get(replica)
        return entry.matched_blocks(hashes) if entry is not None else 0

    def record(self, replica: Hashable, hashes: Sequence[int]) -> None:
        self.of(replica).record(hashes)

    def keep_only(self, live: set) -> None:
        """Forget replicas that are gone: a replacement starts with an empty cache."""
        for replica in list(self.replicas):
            if replica not in live:
                del self.replicas[replica]
