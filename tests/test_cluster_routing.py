"""The cluster router's picture of the replicas' prefix caches (kiln/cluster/prefix_index.py),
without Ray: its block keys are the KV cache's own, and its ranking follows the stated rule
(longest cached prefix, unless that replica is too busy; then the least loaded)."""

import pytest

from kiln.cluster.prefix_index import (
    Candidate,
    PrefixIndex,
    ReplicaPrefixes,
    prompt_block_hashes,
    rank_replicas,
)
from kiln.runtime.engine.request import Request
from kiln.runtime.kv.kv_cache_manager import KVCacheManager
from kiln.runtime.sampling.params import SamplingParams

BS = 16
MODEL_ID = "model.gguf:123"


@pytest.mark.parametrize("n", [0, 15, 16, 17, 47, 48, 100])
def test_block_keys_are_the_kv_caches_own(n):
    ids = [(7 * i + 3) % 5000 for i in range(n)]
    kv = KVCacheManager(num_blocks=64, block_size=BS, model_id=MODEL_ID)
    req = Request(request_id="r", prompt_token_ids=ids, sampling=SamplingParams(), max_tokens=1)
    assert prompt_block_hashes(ids, BS, MODEL_ID) == kv._extend_block_hashes(req, n // BS)


def test_a_prefix_is_matched_block_by_block_from_the_start():
    a = prompt_block_hashes(list(range(64)), BS, MODEL_ID)
    b = prompt_block_hashes(list(range(32)) + [9] * 32, BS, MODEL_ID)  # same first 2 blocks
    c = prompt_block_hashes([9] * 16 + list(range(16, 64)), BS, MODEL_ID)  # differs in block 0
    held = ReplicaPrefixes(capacity_blocks=100)
    held.record(a)
    assert held.matched_blocks(a) == 4
    assert held.matched_blocks(b) == 2
    assert held.matched_blocks(c) == 0  # later blocks chain from another first block


def test_each_replica_forgets_its_least_recently_sent_blocks_at_its_pool_size():
    first = prompt_block_hashes(list(range(48)), BS, MODEL_ID)
    second = prompt_block_hashes(list(range(1000, 1048)), BS, MODEL_ID)
    held = ReplicaPrefixes(capacity_blocks=4)
    held.record(first)
    held.record(second)
    assert len(held) == 4
    assert held.matched_blocks(second) == 3
    assert held.matched_blocks(first) == 0  # its first two blocks were evicted: no run


def test_the_longest_match_wins_whatever_the_order():
    cands = [Candidate("a", 3, 0, 10), Candidate("b", 4, 2, 50), Candidate("c", 0, 0, 0)]
    assert rank_replicas(cands, prompt_blocks=4, imbalance=4) == [["b"], ["a"], ["c"]]


def test_load_wins_when_the_matching_replica_is_too_busy():
    cands = [Candidate("a", 5, 7, 10), Candidate("b", 0, 2, 10)]
    assert rank_replicas(cands, 5, imbalance=5)[0] == ["a"]  # 5 more than b: still allowed
    assert rank_replicas(cands, 5, imbalance=4)[0] == ["b"]  # 5 more than b: too busy


def test_a_match_of_less_than_half_the_prompt_does_not_count():
    # A shared system prompt (2 blocks) ahead of a new 30-block document: spread by load.
    cands = [Candidate("a", 2, 1, 40), Candidate("b", 0, 0, 10)]
    assert rank_replicas(cands, prompt_blocks=32, imbalance=4)[0] == ["b"]
    assert rank_replicas(cands, prompt_blocks=4, imbalance=4)[0] == ["a"]  # half: it counts


def test_without_a_match_the_least_loaded_then_the_emptier_cache_wins():
    cands = [Candidate("a", 0, 1, 0), Candidate("b", 0, 0, 30), Candidate("c", 0, 0, 10)]
    assert rank_replicas(cands, 4, imbalance=4) == [["c"], ["b"], ["a"]]


def test_a_gone_replica_is_forgotten():
    index = PrefixIndex(capacity_blocks=10)
    keys = prompt_block_hashes(list(range(32)), BS, MODEL_ID)
    index.record("a", keys)
    index.record("b", keys[:1])
    index.keep_only({"b"})
    assert index.matched_blocks("a", keys) == 0 and set(index.replicas) == {"b"}
    assert index.matched_blocks("b", keys) == 1
