"""Split-KV attention's second step: a row's partials (one per partition of its keys, written
by kernels/attention.py) merged in increasing partition order."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["sliding_window", "num_seqs", "num_partitions"])
def _reduce_partitions_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, num_partitions, HEAD_DIM_PADDED] fp32
    part_max_ptr,  # [num_tokens, num_heads, num_partitions] fp32, log2 domain
    part_sum_ptr,  # [num_tokens, num_heads, num_partitions] fp32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    sliding_window,
    num_seqs: tl.int32,
    num_partitions,
    head_dim,
    out_token_stride,
    out_head_stride,
    PARTITION_SIZE: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    USE_SLIDING_WINDOW: tl.constexpr,
):
    """One (token, head) row: merge the partials of the partitions its window touches, in
    increasing order, starting from the first one as is (one partition: acc / sum, exactly
    what the unsplit kernel computes)."""
    token_idx = tl.program_id(0).to(tl.int64)
    head_idx = tl.program_id(1).to(tl.int64)
    if token_idx >= tl.load(query_start_loc_ptr + num_seqs):
        return  # padding tokens past the last sequence
    # The sequence owning this token: the last seq_idx with query_start_loc <= token_idx.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= token_idx:
            lo = mid + 1
        else:
            hi = mid
    seq_idx = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq_idx).to(tl.int64)
    query_len = tl.load(query_start_loc_ptr + seq_idx + 1).to(tl.int64) - q_start
    pos = tl.load(seq_lens_ptr + seq_idx).to(tl.int64) - query_len + token_idx - q_start
    first = 0
    if USE_SLIDING_WINDOW:
        first = tl.maximum(pos - sliding_window + 1, 0) // PARTITION_SIZE
    last = pos // PARTITION_SIZE

    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    row = (token_idx * tl.num_programs(1) + head_idx) * num_partitions
    m = tl.load(part_max_ptr + row + first)
    l_sum = tl.load(part_sum_ptr + row + first)
    acc = tl.load(part_acc_ptr + (row + first) * HEAD_DIM_PADDED + offs_d)
    for p in range(first + 1, last + 1):  # every one of these sees at least one key
        m_p = tl.load(part_max_ptr + row + p)
        m_new = tl.maximum(m, m_p)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_p - m_new)
        l_sum = l_sum * alpha + tl.load(part_sum_ptr + row + p) * beta
        acc = acc * alpha + tl.load(part_acc_ptr + (row + p) * HEAD_DIM_PADDED + offs_d) * beta
        m = m_new
    acc = acc / l_sum
    tl.store(out_ptr + token_idx * out_token_stride + head_idx * out_head_stride + offs_d,
             acc.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)
