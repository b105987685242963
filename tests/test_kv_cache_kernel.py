"""The KV store with QK-norm and RoPE on the way (kernels/kv_cache.py): the Triton kernel
against the torch reference and against RoPE written as a complex rotation; -1 slots write
nothing, values are copied bit for bit, K and V in the product are left as they were."""

import pytest
import torch
from conftest import DEVICES

from kiln.kernels import BLOCK_SIZE
from kiln.kernels.kv_cache import rope_store_kvcache, rope_store_kvcache_ref
from kiln.runtime.backends import RopeTable

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SENTINEL = 7.0  # outside randn's range at any of the dtypes
pytestmark = pytest.mark.usefixtures("rows_per_program")


def tol(dtype):
    # one rounding to the activations' dtype apart at most (the kernel rounds once where
    # torch rounds after each op)
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else \
        {"atol": 2e-2, "rtol": 2e-2}


def randn(*shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def rope_case(T, H, KVH, D, rot_dim, dtype, device, num_blocks=8):
    qkv = randn(T, (H + 2 * KVH) * D, dtype=dtype, device=device)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
    gen = torch.Generator().manual_seed(5)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:T]
    slots[1::3] = -1
    positions = torch.randint(0, 4000, (T,), generator=gen)
    cache = torch.full((num_blocks, BLOCK_SIZE, KVH, D), SENTINEL, dtype=dtype, device=device)
    rope = RopeTable(rot_dim, 4096, 10000.0, device)
    return qkv, q, k, v, slots.to(device), positions.to(device), cache, rope


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, KVH, D, rot_dim", [(9, 3, 64, 64), (4, 1, 256, 256),
                                                (2, 1, 128, 64)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_rope_and_store_match_the_reference(H, KVH, D, rot_dim, qk_norm, dtype, device):
    qkv, q, k, v, slots, positions, cache, rope = rope_case(11, H, KVH, D, rot_dim, dtype,
                                                             device)
    norm = (randn(D, dtype=torch.float32, device=device, seed=6),
            randn(D, dtype=torch.float32, device=device, seed=7), 1e-6) if qk_norm else None
    results = []
    for fn in (rope_store_kvcache, rope_store_kvcache_ref):
        mine, kc, vc = qkv.clone(), cache.clone(), cache.clone()
        qm = mine[:, :H * D].view(11, H, D)
        km = mine[:, H * D:(H + KVH) * D].view(11, KVH, D)
        vm = mine[:, (H + KVH) * D:].view(11, KVH, D)
        fn(qm, km, vm, kc, vc, slots, positions, rope.cos, rope.sin, norm)
        results.append((mine, kc, vc))
    (got, got_k, got_v), (want, want_k, want_v) = results
    torch.testing.assert_close(got, want, **tol(dtype))
    torch.testing.assert_close(got_k, want_k, **tol(dtype))
    assert torch.equal(got_v, want_v)  # values are copied, bit for bit
    assert torch.equal(got[:, H * D:], qkv[:, H * D:])  # K and V in the product untouched

    if not qk_norm:  # independently: a rotation of (x[d], x[d + half]) as a complex number
        half = rot_dim // 2
        angle = positions.double()[:, None] * (1.0 / 10000.0 ** (
            torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)).to(device)
        x = q.double()
        z = torch.complex(x[..., :half], x[..., half:rot_dim]) * \
            torch.polar(torch.ones_like(angle), angle)[:, None, :]
        torch.testing.assert_close(got[:, :H * D].view(11, H, D)[..., :half].double(), z.real,
                                   **tol(dtype))
        torch.testing.assert_close(got[:, :H * D].view(11, H, D)[..., half:rot_dim].double(),
                                   z.imag, **tol(dtype))
        assert torch.equal(got[:, :H * D].view(11, H, D)[..., rot_dim:], q[..., rot_dim:])
    untouched = torch.ones(got_k.shape[0] * BLOCK_SIZE, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    assert (got_k.view(-1, KVH, D)[untouched] == SENTINEL).all()




@pytest.mark.parametrize("device", DEVICES)
def test_all_skipped_and_empty_write_nothing_but_still_rotate_the_queries(device):
    qkv, q, k, v, slots, positions, cache, rope = rope_case(5, 2, 1, 64, 64, torch.float32,
                                                             device)
    key_cache, value_cache = cache.clone(), cache.clone()
    rope_store_kvcache(q[:0], k[:0], v[:0], key_cache, value_cache, slots[:0], positions[:0],
                       rope.cos, rope.sin)
    before = q.clone()
    rope_store_kvcache(q, k, v, key_cache, value_cache, torch.full_like(slots, -1), positions,
                       rope.cos, rope.sin)
    assert torch.equal(key_cache, cache) and torch.equal(value_cache, cache)
    assert not torch.equal(q, before)  # padding rows of a graph are rotated all the same
