"""Write this step's new K/V into the paged cache through the slot mapping."""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, block_id * block_size + offset, -1 = skip
    num_kv_heads,
    head_dim,
    key_token_stride,
    key_head_stride,
    value_token_stride,
    value_head_stride,
    key_cache_block_stride,
    key_cache_slot_stride,
    key_cache_head_stride,
    value_cache_block_stride,
    value_cache_slot_stride,
    value_cache_head_stride,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # num_kv_heads padded to a power of 2
    HEAD_DIM_PADDED: tl.constexpr,
):
    token_idx = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token_idx)
    if slot < 0:
        return
    block_idx = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, HEAD_DIM_PADDED)  # [HEAD_DIM_PADDED]
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)

    key = tl.load(key_ptr + token_idx * key_token_stride + offs_h[:, None] * key_head_stride
                  + offs_d[None, :], mask=mask)  # [BLOCK_H, HEAD_DIM_PADDED]
    value = tl.load(value_ptr + token_idx * value_token_stride
                    + offs_h[:, None] * value_head_stride + offs_d[None, :], mask=mask)
    key_dst = (block_idx * key_cache_block_stride + block_offset * key_cache_slot_stride
               + offs_h[:, None] * key_cache_head_stride + offs_d[None, :])
    value_dst = (block_idx * value_cache_block_stride + block_offset * value_cache_slot_stride
                 + offs_h[:, None] * value_cache_head_stride + offs_d[None, :])
    tl.store(key_cache_ptr + key_dst, key, mask=mask)
    tl.store(value_cache_ptr + value_dst, value, mask=mask)


def store_kvcache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"key {tuple(key.shape)} != value {tuple(value.shape)}"
    assert key_cache.dim() == 4 and value_cache.shape == key_cache.shape
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), (
        f"cache heads/dim {tuple(key_cache.shape[2:])} != {(num_kv_heads, head_dim)}")
    assert key.dtype == value.dtype == key_cache.dtype == value_cache.dtype, "dtypes differ"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (num_tokens,)
    assert slot_mapping.is_contiguous()
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    assert key.device == key_cache.device == slot_mapping.device
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, num_kv_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1], BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
    )


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
