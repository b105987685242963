"""Paged attention's torch reference, beside its kernel (kernels/attention.py), and also the
CPU runtime's attention: the same cache layout and the same semantics (causal, GQA, sliding
window), one sequence at a time."""

import torch


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    sliding_window: int = 0,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """Plain torch, one sequence at a time: the CPU runtime's attention and the kernel's oracle.

    Each sequence is computed on its own, so a row never depends on the other sequences of
    the batch. It is not bitwise invariant to how a prompt is chunked: the matmul shapes and
    softmax lengths change with the chunk (the Triton kernel is invariant).
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group_size = num_heads // num_kv_heads
    assert num_heads % num_kv_heads == 0 and key_cache.shape[3] == head_dim
    assert value_cache.shape == key_cache.shape
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.dtype == query.dtype
    starts = query_start_loc.tolist()
    for seq_idx, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[seq_idx], starts[seq_idx + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        context_len = seq_len - query_len
        # Keys before the first query's window are never needed.
        kv_lo = max(0, context_len + 1 - sliding_window) if sliding_window > 0 else 0
        first_block = kv_lo // block_size
        blocks = block_tables[seq_idx, first_block:(seq_len + block_size - 1) // block_size]
        lo, hi = kv_lo - first_block * block_size, seq_len - first_block * block_size
        # Gather the sequence's blocks (one copy), then view them per KV head.
        k = key_cache.index_select(0, blocks).flatten(0, 1)[lo:hi].transpose(0, 1)
        v = value_cache.index_select(0, blocks).flatten(0, 1)[lo:hi].transpose(0, 1)
        num_keys = hi - lo  # k, v: [num_kv_heads, num_keys, head_dim]

        # GQA without repeating K/V: the group's query heads become extra rows of one KV head.
        q = query[q_start:q_end].view(query_len, num_kv_heads, group_size, head_dim)
        q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group_size * query_len, head_dim)
        scores = torch.bmm(q.float(), k.float().transpose(1, 2)).mul_(scale)
        if query_len > 1:  # a single query sees every key kept above
            q_pos = torch.arange(context_len, seq_len, device=query.device)[:, None]
            k_pos = torch.arange(kv_lo, seq_len, device=query.device)[None, :]
            masked = k_pos > q_pos  # [query_len, num_keys]
            if sliding_window > 0:
                masked |= k_pos <= q_pos - sliding_window
            scores.view(num_kv_heads, group_size, query_len, num_keys).masked_fill_(
                masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [num_kv_heads, group * query_len, num_keys]
        o = torch.bmm(probs, v.float())  # [num_kv_heads, group * query_len, head_dim]
        out[q_start:q_end] = o.view(num_kv_heads, group_size, query_len, head_dim).permute(
            2, 0, 1, 3).reshape(query_len, num_heads, head_dim)
    return out
