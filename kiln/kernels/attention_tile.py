"""One query tile's part of paged attention (kernels/attention.py): its rows, its online
softmax over one tile of keys, its output. A program of the prefill grid runs up to four
query tiles over the same K/V tiles (each key tile read once for all of them); every tile is
the same [BLOCK_M, BLOCK_N] work whichever program runs it, so a row's bits do not depend on
how many tiles its program holds."""

import triton
import triton.language as tl


@triton.jit
def _find_seq_idx(
    query_start_loc_ptr,  # [num_seqs + 1] int32
    q_block_idx,
    num_seqs,
    TILE_Q: tl.constexpr,  # query positions per program
):
    """Largest seq i whose first program `query_start_loc[i] // TILE_Q + 2 * i` <= q_block_idx.

    Seq i spans at most query_len // TILE_Q + 2 position-aligned programs, so reserving that
    many grid slots per sequence needs no host sync to build the grid.
    """
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // TILE_Q + 2 * mid
        if first_tile <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _query_rows(tile_pos, first_pos, last_pos, q_start, context_len, offs_m,
                GROUP_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr):
    """The rows of the query tile at absolute positions [tile_pos, tile_pos + BLOCK_Q): row m
    is position tile_pos + m // GROUP_SIZE; returns (positions, query/out rows, mask)."""
    q_pos = tile_pos + offs_m // GROUP_SIZE  # [BLOCK_M]
    token_idx = q_start + q_pos - context_len  # [BLOCK_M]
    row_mask = (offs_m < BLOCK_Q * GROUP_SIZE) & (q_pos >= first_pos) & (q_pos <= last_pos)
    return q_pos, token_idx, row_mask


@triton.jit
def _load_query(query_ptr, token_idx, q_head, row_mask, d_mask, query_token_stride,
                DOT_DTYPE: tl.constexpr):
    """The tile's rows of Q: [BLOCK_M, HEAD_DIM_PADDED]; q_head: each row's head offsets."""
    return tl.load(query_ptr + token_idx[:, None] * query_token_stride + q_head,
                   mask=row_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)


@triton.jit
def _scores(Q, K, m_i, l_i, q_pos, offs_n, kv_mask, qk_scale, sliding_window,
            USE_SLIDING_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The tile's online-softmax step over one tile of keys: (P, alpha, new max, new sum).
    Q: [BLOCK_M, HEAD_DIM_PADDED], K: [HEAD_DIM_PADDED, BLOCK_N]."""
    S = tl.dot(Q, K, input_precision=DOT_PRECISION) * qk_scale  # S: [BLOCK_M, BLOCK_N]
    causal = (offs_n[None, :] <= q_pos[:, None]) & kv_mask[None, :]  # [BLOCK_M, BLOCK_N]
    if USE_SLIDING_WINDOW:  # HF: kv_idx > q_idx - W, the last W positions incl. itself
        causal = causal & (offs_n[None, :] > q_pos[:, None] - sliding_window)
    S = tl.where(causal, S, float("-inf"))
    # A row that has seen no key yet keeps m_i = -inf; subtracting 0 instead keeps it
    # NaN-free and leaves it exactly empty (alpha = 0, p = 0). A key tile wholly outside a
    # row's window is an exact no-op for it (P = 0, alpha = 1, or alpha = 0 while empty).
    m_new = tl.maximum(m_i, tl.max(S, 1))  # [BLOCK_M]
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # [BLOCK_M]
    alpha = tl.exp2(m_i - m_sub)  # [BLOCK_M]
    P = tl.exp2(S - m_sub[:, None])  # P: [BLOCK_M, BLOCK_N]
    return P, alpha, m_new, l_i * alpha + tl.sum(P, 1)


@triton.jit
def _accumulate(acc, P, alpha, V, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc: [BLOCK_M, HEAD_DIM_PADDED] fp32, V: [BLOCK_N, HEAD_DIM_PADDED]."""
    acc = acc * alpha[:, None]
    P = P.to(V.dtype).to(DOT_DTYPE)  # round P to the cache dtype, as on tensor cores
    return tl.dot(P, V.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)


@triton.jit
def _store_rows(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, acc, m_i, l_i, token_idx,
                head_idx, row_mask, d_mask, offs_d, partition_idx, num_partitions,
                out_token_stride, out_head_stride, num_heads,
                HEAD_DIM_PADDED: tl.constexpr, SPLIT: tl.constexpr):
    """The tile's rows: their partials for the reduction (SPLIT), else their output."""
    if SPLIT:
        # Rows outside this partition's part of their window stay empty; the reduction
        # reads only the partitions a row's window touches, so it never sees them.
        part_row = (token_idx * num_heads + head_idx) * num_partitions + partition_idx
        tl.store(part_max_ptr + part_row, m_i, mask=row_mask)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_mask)
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM_PADDED + offs_d[None, :], acc,
                 mask=row_mask[:, None])
    else:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only: every real row sees itself
        acc = acc / l_i[:, None]
        o_offs = token_idx[:, None] * out_token_stride + head_idx[:, None] * out_head_stride
        tl.store(out_ptr + o_offs + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & d_mask[None, :])
