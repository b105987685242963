"""Write this step's new K/V into the paged cache through the slot mapping, with what attention's
inputs need on the way, in one kernel: QK-norm (Qwen3, Gemma 3: an RMSNorm over each head) and
RoPE on the queries and keys. A program per token rotates its query heads in place and writes
its rotated keys and its values to their slot (-1: nowhere; padding rows of a graph).

The decode step had ~13 kernels for RoPE alone (gathers of cos and sin, casts, six products,
a cat and a copy back), two for the QK-norms and one for the store. RoPE here is NeoX's
rotate_half over the first rot_dim values of a head (the rest pass through): for d < rot_dim / 2,
out[d] = x[d] cos - x[d + half] sin and out[d + half] = x[d + half] cos + x[d] sin, in fp32,
cos and sin from the model's table at the token's position.
"""

import torch
import triton
import triton.language as tl

from kiln.kernels import INTERPRET
from kiln.kernels.rms_norm import rms_norm_heads_ref_

# A program per token on a GPU; the interpreter runs programs one after another: many there.
TOKENS_PER_PROGRAM = 64 if INTERPRET else 1


@triton.jit
def _normed_rotated(
    ptr,  # [ROWS, HEAD_DIM_PADDED] pointers: a row is one head of one token
    partner_ptr,  # the same rows at each value's rotate_half partner
    mask,  # [ROWS, HEAD_DIM_PADDED]
    offs_d,  # [HEAD_DIM_PADDED]
    partner,  # [HEAD_DIM_PADDED]
    norm_weight_ptr,  # [head_dim] fp32 (NORM)
    cos,  # [ROWS, HEAD_DIM_PADDED] fp32, cos of each value's angle (1 past rot_dim)
    sin_signed,  # [ROWS, HEAD_DIM_PADDED] fp32: -sin on the first half, sin on the second
    head_dim,
    eps,
    NORM: tl.constexpr,
):
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(partner_ptr, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        # rounded to the activations' dtype, as the separate norm's in-place output was
        dt = ptr.dtype.element_ty
        r = tl.rsqrt(tl.sum(x * x, axis=1) / head_dim + eps)[:, None]  # [ROWS, 1]
        w = tl.load(norm_weight_ptr + offs_d, mask=offs_d < head_dim, other=0.0)
        wp = tl.load(norm_weight_ptr + partner, mask=offs_d < head_dim, other=0.0)
        x = (x * r * w[None, :]).to(dt).to(tl.float32)
        xp = (xp * r * wp[None, :]).to(dt).to(tl.float32)
    return x * cos + xp * sin_signed


@triton.jit
def _angles(positions_ptr, cos_ptr, sin_ptr, token, token_mask, offs_d, half):
    """cos and signed sin of each value's angle: [len(token), HEAD_DIM_PADDED] each."""
    first = offs_d < half
    rotated = (offs_d < 2 * half)[None, :] & token_mask[:, None]
    freq = tl.where(first, offs_d, offs_d - half)  # [HEAD_DIM_PADDED]
    pos = tl.load(positions_ptr + token, mask=token_mask, other=0)
    at = (pos * half)[:, None] + freq[None, :]
    cos = tl.load(cos_ptr + at, mask=rotated, other=1.0)
    sin = tl.load(sin_ptr + at, mask=rotated, other=0.0)
    return cos, tl.where(first[None, :], -sin, sin)


# The token count changes with the batch: not specialised on (kernels/warmup.py).
@triton.jit(do_not_specialize=["num_tokens"])
def _rope_store_kernel(
    query_ptr,  # [T, num_heads, head_dim] view: rotated in place
    key_ptr,  # [T, num_kv_heads, head_dim] view
    value_ptr,  # [T, num_kv_heads, head_dim] view
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [T] int64, block_id * block_size + offset, -1 = do not store
    positions_ptr,  # [T] int64
    cos_ptr,  # [max_position, rot_dim / 2] fp32
    sin_ptr,  # [max_position, rot_dim / 2] fp32
    q_norm_ptr,  # [head_dim] fp32 (QK_NORM)
    k_norm_ptr,  # [head_dim] fp32 (QK_NORM)
    num_tokens,
    num_heads,
    num_kv_heads,
    head_dim,
    half,  # rot_dim / 2
    eps,
    query_token_stride,
    query_head_stride,
    key_token_stride,
    key_head_stride,
    value_token_stride,
    value_head_stride,
    cache_block_stride,  # the key and value caches have one layout
    cache_slot_stride,
    cache_head_stride,
    QK_NORM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    BLOCK_T: tl.constexpr,  # tokens per program: 1 on a GPU, more in the interpreter
    BLOCK_H: tl.constexpr,  # num_heads padded to a power of 2
    BLOCK_KVH: tl.constexpr,  # num_kv_heads padded to a power of 2
    HEAD_DIM_PADDED: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM_PADDED)  # [HEAD_DIM_PADDED]
    partner = tl.where(offs_d < half, offs_d + half,
                       tl.where(offs_d < 2 * half, offs_d - half, offs_d))
    d_mask = offs_d < head_dim
    first_token = tl.program_id(0).to(tl.int64) * BLOCK_T

    # rows of (token, query head): m = t * BLOCK_H + head
    offs_m = tl.arange(0, BLOCK_T * BLOCK_H)
    token = first_token + offs_m // BLOCK_H  # [BLOCK_T * BLOCK_H]
    head = offs_m % BLOCK_H
    token_mask = token < num_tokens
    mask = (token_mask & (head < num_heads))[:, None] & d_mask[None, :]
    cos, sin_signed = _angles(positions_ptr, cos_ptr, sin_ptr, token, token_mask, offs_d, half)
    rows = query_ptr + (token * query_token_stride + head * query_head_stride)[:, None]
    q = _normed_rotated(rows + offs_d[None, :], rows + partner[None, :], mask, offs_d, partner,
                        q_norm_ptr, cos, sin_signed, head_dim, eps, QK_NORM)
    tl.store(rows + offs_d[None, :], q.to(query_ptr.dtype.element_ty), mask=mask)

    # rows of (token, KV head), those of tokens with a slot
    offs_m = tl.arange(0, BLOCK_T * BLOCK_KVH)
    token = first_token + offs_m // BLOCK_KVH  # [BLOCK_T * BLOCK_KVH]
    head = offs_m % BLOCK_KVH
    slot = tl.load(slot_mapping_ptr + token, mask=token < num_tokens, other=-1)
    token_mask = slot >= 0
    mask = (token_mask & (head < num_kv_heads))[:, None] & d_mask[None, :]
    cos, sin_signed = _angles(positions_ptr, cos_ptr, sin_ptr, token, token_mask, offs_d, half)
    rows = key_ptr + (token * key_token_stride + head * key_head_stride)[:, None]
    k = _normed_rotated(rows + offs_d[None, :], rows + partner[None, :], mask, offs_d, partner,
                        k_norm_ptr, cos, sin_signed, head_dim, eps, QK_NORM)
    v = tl.load(value_ptr + (token * value_token_stride + head * value_head_stride)[:, None]
                + offs_d[None, :], mask=mask)
    dst = ((slot // BLOCK_SIZE) * cache_block_stride + (slot % BLOCK_SIZE) * cache_slot_stride
           + head * cache_head_stride)[:, None] + offs_d[None, :]
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


def rope_store_kvcache(
    query: torch.Tensor,  # [T, num_heads, head_dim] view, values contiguous: rotated in place
    key: torch.Tensor,  # [T, num_kv_heads, head_dim] view: read, not changed
    value: torch.Tensor,  # [T, num_kv_heads, head_dim] view
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = do not store
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [max_position, rot_dim / 2] fp32
    sin: torch.Tensor,  # [max_position, rot_dim / 2] fp32
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # (q weight, k weight, eps)
) -> None:
    T, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert key.shape == value.shape == (T, num_kv_heads, head_dim)
    assert key_cache.shape == value_cache.shape and key_cache.shape[2:] == key.shape[1:]
    assert key_cache.stride() == value_cache.stride()
    assert query.stride(2) == key.stride(2) == value.stride(2) == key_cache.stride(3) == 1
    assert slot_mapping.dtype == positions.dtype == torch.int64
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape
    half = cos.shape[1]
    assert 2 * half <= head_dim
    if T == 0:
        return
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    block_t = TOKENS_PER_PROGRAM
    _rope_store_kernel[(triton.cdiv(T, block_t),)](
        query, key, value, key_cache, value_cache, slot_mapping, positions, cos, sin,
        q_norm, k_norm, T, num_heads, num_kv_heads, head_dim, half, eps,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        QK_NORM=qk_norm is not None, BLOCK_SIZE=key_cache.shape[1], BLOCK_T=block_t,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim))


def rope_ref_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> None:
    """x: [T, H, D] view, its first 2 * half values rotated in place (rotate_half)."""
    half = cos.shape[1]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
    x[..., :2 * half] = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rope_store_kvcache_ref(query, key, value, key_cache, value_cache, slot_mapping, positions,
                           cos, sin, qk_norm=None) -> None:
    """The same in torch: query rotated in place, key rotated on a copy."""
    key = key.clone()
    if qk_norm is not None:
        q_norm, k_norm, eps = qk_norm
        rms_norm_heads_ref_(query, q_norm, eps)
        rms_norm_heads_ref_(key, k_norm, eps)
    rope_ref_(query, positions, cos, sin)
    rope_ref_(key, positions, cos, sin)
    store_kvcache_ref(key, value, key_cache, value_cache, slot_mapping)


def store_kvcache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # view (not reshape): a cache that cannot be flattened in place is a layout bug.
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[keep])
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[keep])
