"""Paged attention over the block-table KV cache: prefill chunks and decode in one launch.

Every sequence has `num_computed_tokens` (context) catching up with its `seq_len`; this step
brings `query_len` new tokens, whose K/V rope_store_kvcache has already written. Query j of a
sequence sits at absolute position `context_len + j` and attends causally over the cache.

Sliding window (Gemma 3 / Hugging Face convention, transformers' `sliding_window_overlay`:
`kv_idx > q_idx - sliding_window`): with W > 0 a query at position p sees keys at positions
p - W < k <= p, i.e. the last W positions including itself.

Determinism (why: a request must get the same bits whichever requests the scheduler batches
it with and however it chunks its prompt, so seeded sampling is reproducible and a prefix
cache hit equals recomputation). A query row's output depends only on its own sequence's
cache and position:
- each program owns BLOCK_Q query positions aligned to absolute positions, so a row always
  sits in the same slot of the same-shaped tile, whoever its neighbours are;
- it walks the KV cache in BLOCK_N tiles aligned to absolute positions 0, BLOCK_N,
  2 * BLOCK_N ..., always in increasing order, so a row's partial sums are formed the same way;
- a tile outside a row's causal window is an exact no-op for that row (P = 0 with alpha = 1,
  or alpha = 0 on a still-empty row), so the extra tiles a program walks for its other rows
  cannot perturb it;
- block shapes depend only on the model (head_dim, GQA group), never on the batch.

Split-KV (flash-decoding): at batch 1 a launch has only num_kv_heads programs per query tile,
a few of an H200's 132 SMs. So every row's keys are cut into partitions of PARTITION_SIZE
positions aligned to absolute position 0; a program handles one (query tile, KV head,
partition) and, when the launch spans more than one partition, writes its unnormalised
partial (max, sum, acc) to a workspace that `_reduce_partitions_kernel` merges per row in
increasing partition order. The cut depends only on a row's position, never on the batch, so
the invariance above holds; a row whose keys fit one partition takes its first partial as is,
so it gets the same bits whether or not the launch needed the reduction.
"""

import math

import torch
import triton
import triton.language as tl

from kiln.kernels import INTERPRET
from kiln.kernels.attention_reduce import _reduce_partitions_kernel


@triton.jit
def _find_seq_idx(
    query_start_loc_ptr,  # [num_seqs + 1] int32
    q_block_idx,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    """Largest seq i whose first query tile `query_start_loc[i] // BLOCK_Q + 2 * i` <= q_block_idx.

    Seq i spans at most query_len // BLOCK_Q + 2 position-aligned tiles, so reserving that
    many grid slots per sequence needs no host sync to build the grid.
    """
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + 2 * mid
        if first_tile <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Values that change with the batch are not specialised on (Triton would compile a variant
# for 1, for multiples of 16 and for the rest): a model's steps then need only the variants
# compiled at load (kernels/warmup.py).
@triton.jit(do_not_specialize=["sliding_window", "num_seqs", "block_table_stride",
                               "num_partitions"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, num_partitions, HEAD_DIM_PADDED] fp32 (SPLIT)
    part_max_ptr,  # [num_tokens, num_heads, num_partitions] fp32, log2 domain (SPLIT)
    part_sum_ptr,  # [num_tokens, num_heads, num_partitions] fp32 (SPLIT)
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    qk_scale,  # float: softmax scale * log2(e)
    sliding_window,  # int, used only when USE_SLIDING_WINDOW
    num_seqs: tl.int32,  # annotated: never specialised to a constexpr (it seeds a loop var)
    head_dim,
    out_token_stride,
    out_head_stride,
    query_token_stride,
    query_head_stride,
    key_block_stride,
    key_slot_stride,
    key_head_stride,
    value_block_stride,
    value_slot_stride,
    value_head_stride,
    block_table_stride,
    num_partitions,
    GROUP_SIZE: tl.constexpr,  # num_heads // num_kv_heads
    BLOCK_Q: tl.constexpr,  # query positions per program
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q * GROUP_SIZE, padded to a power of 2
    BLOCK_N: tl.constexpr,  # key positions per inner tile
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    HEAD_DIM_PADDED: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,  # key positions per partition, a multiple of BLOCK_N
    SPLIT: tl.constexpr,  # the launch spans more than one partition: write partials
    DECODE: tl.constexpr,  # one query token a sequence: a program per sequence (no search)
    USE_SLIDING_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # dtype of tl.dot operands (see _dot_dtype)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands, so fp32 is not silently tf32
):
    kv_head_idx = tl.program_id(1).to(tl.int64)
    partition_idx = tl.program_id(2).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, HEAD_DIM_PADDED)  # [HEAD_DIM_PADDED]
    head_idx = kv_head_idx * GROUP_SIZE + offs_m % GROUP_SIZE  # [BLOCK_M]
    if DECODE:
        # One token a sequence (token i is sequence i's): a program per sequence, no search,
        # its rows the token's GROUP_SIZE heads. The same tiles of keys and the same dots
        # as below: a row gets the same bits from either grid.
        seq_idx = tl.program_id(0).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + seq_idx).to(tl.int64)
        first_pos = seq_len - 1
        last_pos = first_pos
        q_pos = first_pos + offs_m * 0  # [BLOCK_M] absolute positions
        token_idx = seq_idx + offs_m * 0  # [BLOCK_M] rows of query/out
        row_mask = offs_m < GROUP_SIZE
    else:
        q_block_idx = tl.program_id(0).to(tl.int64)
        seq_idx = _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs,
                                BLOCK_Q).to(tl.int64)
        q_start = tl.load(query_start_loc_ptr + seq_idx).to(tl.int64)
        query_len = tl.load(query_start_loc_ptr + seq_idx + 1).to(tl.int64) - q_start
        seq_len = tl.load(seq_lens_ptr + seq_idx).to(tl.int64)
        context_len = seq_len - query_len

        # This program's query tile covers absolute positions [tile_pos, tile_pos + BLOCK_Q).
        tile_local = q_block_idx - (q_start // BLOCK_Q + 2 * seq_idx)
        tile_pos = (context_len // BLOCK_Q + tile_local) * BLOCK_Q
        if tile_pos >= seq_len:
            return
        first_pos = tl.maximum(tile_pos, context_len)
        last_pos = tl.minimum(tile_pos + BLOCK_Q, seq_len) - 1

        # Row m is query position tile_pos + m // GROUP_SIZE, head kv_head * GROUP + m % GROUP.
        q_pos = tile_pos + offs_m // GROUP_SIZE  # [BLOCK_M] absolute positions
        token_idx = q_start + q_pos - context_len  # [BLOCK_M] rows of query/out
        row_mask = (offs_m < BLOCK_Q * GROUP_SIZE) & (q_pos >= first_pos) & (q_pos <= last_pos)
    d_mask = offs_d < head_dim

    q_offs = token_idx[:, None] * query_token_stride + head_idx[:, None] * query_head_stride
    Q = tl.load(query_ptr + q_offs + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    Q = Q.to(DOT_DTYPE)  # Q: [BLOCK_M, HEAD_DIM_PADDED]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)

    kv_start = 0
    if USE_SLIDING_WINDOW:
        kv_start = tl.maximum(first_pos - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
    kv_end = last_pos + 1
    # This program's partition of the tile's keys; none of them: nothing to write.
    part_start = partition_idx * PARTITION_SIZE
    if (part_start >= kv_end) | (part_start + PARTITION_SIZE <= kv_start):
        return
    kv_start = tl.maximum(kv_start, part_start)
    kv_end = tl.minimum(kv_end, part_start + PARTITION_SIZE)
    table_ptr = block_tables_ptr + seq_idx * block_table_stride
    offs_n = kv_start + tl.arange(0, BLOCK_N)
    next_block = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=offs_n < kv_end, other=0)
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] absolute key positions
        kv_mask = offs_n < kv_end  # [BLOCK_N]
        physical_block = next_block.to(tl.int64)
        # The next tile's block ids now: K/V addresses then never wait on a load of this
        # iteration, so the pipeliner can keep several tiles of K/V in flight.
        next_block = tl.load(table_ptr + (offs_n + BLOCK_N) // BLOCK_SIZE,
                             mask=offs_n + BLOCK_N < kv_end, other=0)
        slot = offs_n % BLOCK_SIZE  # [BLOCK_N]

        k_offs = (physical_block[None, :] * key_block_stride + slot[None, :] * key_slot_stride
                  + kv_head_idx * key_head_stride + offs_d[:, None])
        K = tl.load(key_cache_ptr + k_offs, mask=kv_mask[None, :] & d_mask[:, None],
                    other=0.0).to(DOT_DTYPE)  # K: [HEAD_DIM_PADDED, BLOCK_N]
        S = tl.dot(Q, K, input_precision=DOT_PRECISION) * qk_scale  # S: [BLOCK_M, BLOCK_N]

        causal = (offs_n[None, :] <= q_pos[:, None]) & kv_mask[None, :]  # [BLOCK_M, BLOCK_N]
        if USE_SLIDING_WINDOW:  # HF: kv_idx > q_idx - W, the last W positions incl. itself
            causal = causal & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        S = tl.where(causal, S, float("-inf"))

        # Online softmax. A row that has seen no key yet keeps m_i = -inf; subtracting 0
        # instead keeps it NaN-free and leaves it exactly empty (alpha = 0, p = 0).
        m_new = tl.maximum(m_i, tl.max(S, 1))  # [BLOCK_M]
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # [BLOCK_M]
        alpha = tl.exp2(m_i - m_sub)  # [BLOCK_M]
        P = tl.exp2(S - m_sub[:, None])  # P: [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(P, 1)

        v_offs = (physical_block[:, None] * value_block_stride + slot[:, None] * value_slot_stride
                  + kv_head_idx * value_head_stride + offs_d[None, :])
        V = tl.load(value_cache_ptr + v_offs, mask=kv_mask[:, None] & d_mask[None, :],
                    other=0.0)  # V: [BLOCK_N, HEAD_DIM_PADDED]
        acc = acc * alpha[:, None]
        P = P.to(V.dtype).to(DOT_DTYPE)  # round P to the cache dtype, as on tensor cores
        acc = tl.dot(P, V.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # Rows outside this partition's part of their window stay empty; the reduction
        # reads only the partitions a row's window touches, so it never sees them.
        part_row = (token_idx * (GROUP_SIZE * tl.num_programs(1)) + head_idx) * num_partitions \
            + partition_idx  # [BLOCK_M]
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


# Key positions per split-KV partition: a decode row at 4k context spreads over 8 programs
# per KV head. Fixed (not from the batch), so every row is cut the same way in every launch.
PARTITION_SIZE = 512

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """tl.dot operand dtype: the cache dtype, except bf16 under Triton's interpreter.

    The interpreter (the only way Triton runs on CPU tensors) stores bf16 as uint16 and its
    tl.dot multiplies the raw bit patterns (triton-lang/triton#11584, "not supported yet").
    bf16 -> fp32 is exact, so an fp32 dot of the same bf16 values gives the tensor-core result.
    """
    if dtype == torch.bfloat16 and INTERPRET:
        return tl.float32
    return _TL_DTYPES[dtype]


def _tile_sizes(group_size: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N) from the model's shapes only, never from the batch."""
    block_m = max(16, triton.next_power_of_2(group_size))
    block_q = block_m // group_size
    block_n = 64 if head_dim <= 128 else 32
    return block_q, block_m, block_n


def is_decode_step(num_tokens: int, num_seqs: int, max_query_len: int | None) -> bool:
    """One token a sequence, as the host knows from its bound on query lengths."""
    return max_query_len == 1 and num_tokens == num_seqs


def query_programs(num_tokens: int, num_seqs: int, max_query_len: int | None,
                   block_q: int) -> int:
    """The grid's first axis: a program per sequence in a decode step, otherwise room for
    every sequence's position-aligned query tiles."""
    if is_decode_step(num_tokens, num_seqs, max_query_len):
        return num_seqs
    return num_tokens // block_q + 2 * num_seqs


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    sliding_window: int = 0,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    max_seq_len: int | None = None,  # host-known bound on seq_lens (saves a device sync)
    partition_size: int = PARTITION_SIZE,
    max_query_len: int | None = None,  # host-known bound on query lengths (1: decode grid)
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    num_seqs = seq_lens.shape[0]
    assert value_cache.shape == key_cache.shape, "key_cache and value_cache shapes differ"
    assert cache_head_dim == head_dim, f"head_dim {head_dim} != cache head_dim {cache_head_dim}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads}"
    assert query.dtype in (torch.float32, torch.bfloat16, torch.float16), query.dtype
    assert key_cache.dtype == value_cache.dtype == query.dtype, "query/cache dtypes differ"
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
        assert t.device == query.device, f"{name} on {t.device}, query on {query.device}"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert query_start_loc.shape == (num_seqs + 1,)
    assert block_tables.stride(1) == 1 and seq_lens.is_contiguous()
    assert query_start_loc.is_contiguous()
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    assert sliding_window >= 0
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    group_size = num_heads // num_kv_heads
    block_q, block_m, block_n = _tile_sizes(group_size, head_dim)
    assert partition_size % block_n == 0, f"partition_size must be a multiple of {block_n}"
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    num_partitions = triton.cdiv(max_seq_len, partition_size)
    split = num_partitions > 1
    head_dim_padded = triton.next_power_of_2(head_dim)
    part_acc = part_max = part_sum = out  # placeholders, unused without a split
    if split:
        part_max = torch.empty((num_tokens, num_heads, num_partitions), dtype=torch.float32,
                               device=query.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((num_tokens, num_heads, num_partitions, head_dim_padded),
                               dtype=torch.float32, device=query.device)
    decode = is_decode_step(num_tokens, num_seqs, max_query_len)
    grid = (query_programs(num_tokens, num_seqs, max_query_len, block_q), num_kv_heads,
            num_partitions)
    dot_dtype = _dot_dtype(query.dtype)
    _paged_attention_kernel[grid](
        out, part_acc, part_max, part_sum, query, key_cache, value_cache, block_tables,
        seq_lens, query_start_loc, scale * math.log2(math.e), sliding_window, num_seqs,
        head_dim, out.stride(0), out.stride(1), query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), num_partitions,
        GROUP_SIZE=group_size, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, HEAD_DIM_PADDED=head_dim_padded,
        PARTITION_SIZE=partition_size, SPLIT=split, DECODE=decode,
        USE_SLIDING_WINDOW=sliding_window > 0,
        # "tf32" is tl.dot's default and only affects fp32 operands, which always get "ieee".
        DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        num_warps=4,
    )
    if split:
        _reduce_partitions_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, seq_lens, query_start_loc, sliding_window,
            num_seqs, num_partitions, head_dim, out.stride(0), out.stride(1),
            PARTITION_SIZE=partition_size, HEAD_DIM_PADDED=head_dim_padded,
            USE_SLIDING_WINDOW=sliding_window > 0, num_warps=1,
        )
    return out

