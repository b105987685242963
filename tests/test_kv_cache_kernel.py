"""store_kvcache: the Triton kernel against the torch reference; -1 slots write nothing."""

import pytest
import torch
from conftest import DEVICES

from kiln.kernels import BLOCK_SIZE
from kiln.kernels.kv_cache import store_kvcache, store_kvcache_ref

SENTINEL = 7.0  # outside randn's range at any of the dtypes


def make_inputs(num_tokens, num_kv_heads, head_dim, dtype, device, num_blocks=6, seed=0):
    """K/V as strided views of a packed QKV projection; distinct scrambled slots, every
    fourth token -1, and the cache's very last slot never targeted (a -1 that wrapped around
    as a Python index would land exactly there)."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = 2 * num_kv_heads
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    qkv = qkv.to(dtype=dtype, device=device)
    key = qkv[:, num_heads:num_heads + num_kv_heads]  # [num_tokens, num_kv_heads, head_dim]
    value = qkv[:, num_heads + num_kv_heads:]
    slots = torch.randperm(num_blocks * BLOCK_SIZE - 1, generator=gen)[:num_tokens]
    slots[::4] = -1
    cache = torch.full((num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), SENTINEL, dtype=dtype,
                       device=device)
    return key, value, cache, slots.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads, head_dim", [(1, 64), (3, 64), (2, 128), (1, 256),
                                                    (3, 80)])
def test_store_kvcache_matches_reference(num_kv_heads, head_dim, dtype, device):
    key, value, cache, slots = make_inputs(37, num_kv_heads, head_dim, dtype, device)
    key_cache, value_cache = cache.clone(), cache.clone()
    ref_key_cache, ref_value_cache = cache.clone(), cache.clone()
    store_kvcache(key, value, key_cache, value_cache, slots)
    store_kvcache_ref(key, value, ref_key_cache, ref_value_cache, slots)
    assert torch.equal(key_cache, ref_key_cache)
    assert torch.equal(value_cache, ref_value_cache)

    # Independently of the reference: stored rows are exact, every other slot untouched.
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    kept = slots >= 0
    assert torch.equal(flat_k[slots[kept]], key[kept])
    assert torch.equal(flat_v[slots[kept]], value[kept])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=device)
    untouched[slots[kept]] = False
    assert untouched[-1], "the last slot must be free for the wrap-around check"
    assert (flat_k[untouched] == SENTINEL).all() and (flat_v[untouched] == SENTINEL).all()


@pytest.mark.parametrize("device", DEVICES)
def test_store_kvcache_all_skipped_and_empty_write_nothing(device):
    key, value, cache, slots = make_inputs(5, 2, 64, torch.float32, device)
    key_cache, value_cache = cache.clone(), cache.clone()
    store_kvcache(key, value, key_cache, value_cache, torch.full_like(slots, -1))
    store_kvcache(key[:0], value[:0], key_cache, value_cache, slots[:0])
    assert torch.equal(key_cache, cache) and torch.equal(value_cache, cache)
