"""BlockPool / KVCacheManager invariants under random operation sequences (hypothesis)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.runtime.engine.request import Request
from kiln.runtime.kv.block_pool import BlockPool
from kiln.runtime.kv.kv_cache_manager import KVCacheManager
from kiln.runtime.sampling.params import SamplingParams

BS = 16


def _check_invariants(pool: BlockPool) -> None:
    free = list(pool.free_block_queue)
    assert len(free) == pool.get_num_free_blocks()
    assert len({b.block_id for b in free}) == len(free), "a block is queued twice"
    for b in pool.blocks:
        assert b.ref_cnt >= 0
        assert (b in free) == (b.ref_cnt == 0), b
    for h, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h and b.token_ids is not None


ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "draft", "free"]),
                         st.integers(0, 7), st.integers(1, 60)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_invariants_and_leak_nothing(operations):
    kv = KVCacheManager(num_blocks=24, block_size=BS, model_id="m")
    live: dict[int, Request] = {}
    for op, slot, n in operations:
        if op == "add" and slot not in live:
            # Prompts from a few shared prefixes, so prefix hits happen.
            prompt = [slot % 3] * (n // 2) + list(range(n))
            req = Request(f"r{slot}", prompt, SamplingParams(), max_tokens=10)
            hits, num_cached = kv.get_computed_blocks(req)
            assert num_cached <= req.num_tokens - 1
            if kv.allocate_slots(req, req.num_tokens - num_cached, hits):
                req.num_computed_tokens = req.num_tokens
                kv.cache_full_blocks(req, req.num_tokens)
                live[slot] = req
        elif op == "grow" and slot in live:
            req = live[slot]
            for t in range(n % 20):
                if not kv.allocate_slots(req, 1):
                    break
                req.append_output_token(1000 + t)
                req.num_computed_tokens += 1
                kv.cache_full_blocks(req, req.num_computed_tokens)
        elif op == "draft" and slot in live:  # slots for drafts, all rejected
            req = live[slot]
            if kv.allocate_slots(req, 1 + n % 20):
                kv.trim(req, req.num_computed_tokens + 1)
        elif op == "free" and slot in live:
            kv.free(live.pop(slot))
        _check_invariants(kv.block_pool)
        # the runner's tables: one gather of every live request's row, zero past its blocks
        # (rows are truncated by drafts and reused after a free)
        reqs = list(live.values())
        for req, row in zip(reqs, kv.block_tables(reqs).tolist()):
            ids = kv.get_block_ids(req)
            assert row == ids + [0] * (len(row) - len(ids))
        for req in live.values():
            assert len(kv.get_block_ids(req)) * BS >= req.num_computed_tokens
            # the runner's copy of the table, kept up to date in place
            assert kv.block_tables([req])[0].tolist() == kv.get_block_ids(req)
            # every full, computed block is in the prefix cache (indexed once, as filled)
            blocks = kv.req_to_blocks[req.request_id]
            assert all(b.block_hash is not None
                       for b in blocks[:req.num_computed_tokens // BS])
    for req in live.values():
        kv.free(req)
    _check_invariants(kv.block_pool)
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_prefix_hit_is_confirmed_against_token_ids():
    kv = KVCacheManager(num_blocks=8, block_size=BS, model_id="m")
    a = Request("a", list(range(40)), SamplingParams(), max_tokens=1)
    assert kv.allocate_slots(a, 40)
    kv.cache_full_blocks(a, 40)
    b = Request("b", list(range(40)), SamplingParams(), max_tokens=1)
    b.block_hashes = list(a.block_hashes)  # same keys ...
    b.all_token_ids[3] = 999  # ... but different tokens in the first block: no hit
    hits, n = kv.get_computed_blocks(b)
    assert hits == [] and n == 0


def test_hits_are_capped_one_token_short_of_the_prompt():
    kv = KVCacheManager(num_blocks=8, block_size=BS, model_id="m")
    a = Request("a", list(range(32)), SamplingParams(), max_tokens=1)
    assert kv.allocate_slots(a, 32)
    kv.cache_full_blocks(a, 32)
    kv.free(a)
    b = Request("b", list(range(32)), SamplingParams(), max_tokens=1)
    hits, n = kv.get_computed_blocks(b)
    assert n == 16  # the second block would cover the last token, whose logits are needed


def test_eviction_takes_least_recently_used_and_chain_tails_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS, model_id="m")
    a = Request("a", list(range(48)), SamplingParams(), max_tokens=1)
    assert kv.allocate_slots(a, 48)
    kv.cache_full_blocks(a, 48)
    ids = kv.get_block_ids(a)
    kv.free(a)
    order = [b.block_id for b in kv.block_pool.free_block_queue]
    # The untouched block first, then a's chain from its tail to its head.
    assert order[1:] == ids[::-1]
    new = kv.block_pool.get_new_blocks(2)
    assert [b.block_id for b in new][1] == ids[-1]
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
