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
- block shapes depend only on the model (head_dim, GQA group), never on the batch;
- a prefill program may hold up to four consecutive query tiles, reading each K/V tile once
  for all of them (half or a quarter of a long prompt's K/V traffic): each tile's dots, masks
  and sums are those of a program of one tile, and the extra key tiles it walks for its
  neighbours are exact no-ops for it, so the host picks the count freely (sub_tiles).

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
from kiln.kernels.attention_tile import (
    _accumulate,
    _find_seq_idx,
    _load_query,
    _query_rows,
    _scores,
    _store_rows,
)


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
    SUB_TILES: tl.constexpr,  # query tiles a prefill program holds (1, 2 or 4), sharing K/V
    USE_SLIDING_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # dtype of tl.dot operands (see _dot_dtype)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands, so fp32 is not silently tf32
):
    kv_head_idx = tl.program_id(1).to(tl.int64)
    partition_idx = tl.program_id(2).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, HEAD_DIM_PADDED)  # [HEAD_DIM_PADDED]
    head_idx = kv_head_idx * GROUP_SIZE + offs_m % GROUP_SIZE  # [BLOCK_M]
    d_mask = offs_d < head_dim
    if DECODE:
        # One token a sequence (token i is sequence i's): a program per sequence, no search,
        # its rows the token's GROUP_SIZE heads. The same tiles of keys and the same dots
        # as below: a row gets the same bits from either grid.
        seq_idx = tl.program_id(0).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + seq_idx).to(tl.int64)
        first_pos = seq_len - 1
        last_pos = first_pos
        q_pos0 = first_pos + offs_m * 0  # [BLOCK_M] absolute positions
        token_idx0 = seq_idx + offs_m * 0  # [BLOCK_M] rows of query/out
        row_mask0 = offs_m < GROUP_SIZE
    else:
        q_block_idx = tl.program_id(0).to(tl.int64)
        seq_idx = _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs,
                                BLOCK_Q * SUB_TILES).to(tl.int64)
        q_start = tl.load(query_start_loc_ptr + seq_idx).to(tl.int64)
        query_len = tl.load(query_start_loc_ptr + seq_idx + 1).to(tl.int64) - q_start
        seq_len = tl.load(seq_lens_ptr + seq_idx).to(tl.int64)
        context_len = seq_len - query_len

        # This program's SUB_TILES query tiles cover absolute positions [tile_pos, tile_pos +
        # SUB_TILES * BLOCK_Q); tile t starts at tile_pos + t * BLOCK_Q, a multiple of
        # BLOCK_Q as in a program of one tile.
        tile_local = q_block_idx - (q_start // (BLOCK_Q * SUB_TILES) + 2 * seq_idx)
        tile_pos = (context_len // (BLOCK_Q * SUB_TILES) + tile_local) * (BLOCK_Q * SUB_TILES)
        if tile_pos >= seq_len:
            return
        first_pos = tl.maximum(tile_pos, context_len)
        last_pos = tl.minimum(tile_pos + BLOCK_Q * SUB_TILES, seq_len) - 1
        q_pos0, token_idx0, row_mask0 = _query_rows(tile_pos, first_pos, last_pos, q_start,
                                                    context_len, offs_m, GROUP_SIZE, BLOCK_Q)
        if SUB_TILES > 1:
            q_pos1, token_idx1, row_mask1 = _query_rows(
                tile_pos + BLOCK_Q, first_pos, last_pos, q_start, context_len, offs_m,
                GROUP_SIZE, BLOCK_Q)
        if SUB_TILES > 2:
            q_pos2, token_idx2, row_mask2 = _query_rows(
                tile_pos + 2 * BLOCK_Q, first_pos, last_pos, q_start, context_len, offs_m,
                GROUP_SIZE, BLOCK_Q)
            q_pos3, token_idx3, row_mask3 = _query_rows(
                tile_pos + 3 * BLOCK_Q, first_pos, last_pos, q_start, context_len, offs_m,
                GROUP_SIZE, BLOCK_Q)

    # Q, running max (log2 domain), running softmax denominator and output of each tile.
    q_head = head_idx[:, None] * query_head_stride + offs_d[None, :]  # [BLOCK_M, HEAD_DIM_PADDED]
    Q0 = _load_query(query_ptr, token_idx0, q_head, row_mask0, d_mask,
                     query_token_stride, DOT_DTYPE)
    m0 = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l0 = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    if SUB_TILES > 1:
        Q1 = _load_query(query_ptr, token_idx1, q_head, row_mask1, d_mask,
                         query_token_stride, DOT_DTYPE)
        m1, l1, acc1 = m0, l0, acc0
    if SUB_TILES > 2:
        Q2 = _load_query(query_ptr, token_idx2, q_head, row_mask2, d_mask,
                         query_token_stride, DOT_DTYPE)
        Q3 = _load_query(query_ptr, token_idx3, q_head, row_mask3, d_mask,
                         query_token_stride, DOT_DTYPE)
        m2, l2, acc2 = m0, l0, acc0
        m3, l3, acc3 = m0, l0, acc0

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
        P0, alpha0, m0, l0 = _scores(Q0, K, m0, l0, q_pos0, offs_n, kv_mask, qk_scale,
                                     sliding_window, USE_SLIDING_WINDOW, DOT_PRECISION)
        if SUB_TILES > 1:
            P1, alpha1, m1, l1 = _scores(Q1, K, m1, l1, q_pos1, offs_n, kv_mask, qk_scale,
                                         sliding_window, USE_SLIDING_WINDOW, DOT_PRECISION)
        if SUB_TILES > 2:
            P2, alpha2, m2, l2 = _scores(Q2, K, m2, l2, q_pos2, offs_n, kv_mask, qk_scale,
                                         sliding_window, USE_SLIDING_WINDOW, DOT_PRECISION)
            P3, alpha3, m3, l3 = _scores(Q3, K, m3, l3, q_pos3, offs_n, kv_mask, qk_scale,
                                         sliding_window, USE_SLIDING_WINDOW, DOT_PRECISION)

        v_offs = (physical_block[:, None] * value_block_stride + slot[:, None] * value_slot_stride
                  + kv_head_idx * value_head_stride + offs_d[None, :])
        V = tl.load(value_cache_ptr + v_offs, mask=kv_mask[:, None] & d_mask[None, :],
                    other=0.0)  # V: [BLOCK_N, HEAD_DIM_PADDED]
        acc0 = _accumulate(acc0, P0, alpha0, V, DOT_DTYPE, DOT_PRECISION)
        if SUB_TILES > 1:
            acc1 = _accumulate(acc1, P1, alpha1, V, DOT_DTYPE, DOT_PRECISION)
        if SUB_TILES > 2:
            acc2 = _accumulate(acc2, P2, alpha2, V, DOT_DTYPE, DOT_PRECISION)
            acc3 = _accumulate(acc3, P3, alpha3, V, DOT_DTYPE, DOT_PRECISION)

    num_heads = GROUP_SIZE * tl.num_programs(1)
    _store_rows(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, acc0, m0, l0, token_idx0,
                head_idx, row_mask0, d_mask, offs_d, partition_idx, num_partitions,
                out_token_stride, out_head_stride, num_heads, HEAD_DIM_PADDED, SPLIT)
    if SUB_TILES > 1:
        _store_rows(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, acc1, m1, l1,
                    token_idx1, head_idx, row_mask1, d_mask, offs_d, partition_idx,
                    num_partitions, out_token_stride, out_head_stride, num_heads,
                    HEAD_DIM_PADDED, SPLIT)
    if SUB_TILES > 2:
        _store_rows(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, acc2, m2, l2,
                    token_idx2, head_idx, row_mask2, d_mask, offs_d, partition_idx,
                    num_partitions, out_token_stride, out_head_stride, num_heads,
                    HEAD_DIM_PADDED, SPLIT)
        _store_rows(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, acc3, m3, l3,
                    token_idx3, head_idx, row_mask3, d_mask, offs_d, partition_idx,
                    num_partitions, out_token_stride, out_head_stride, num_heads,
                    HEAD_DIM_PADDED, SPLIT)


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


# Query rows a tile holds (positions x a GQA group's heads) on every grid, so a row's dots
# have one shape in decode, prefill and mixed steps. 16: mma.sync's height. 64: one Hopper
# warpgroup's wgmma, each K/V tile read once for 64 rows; at head_dim <= 128 its sm_90 code
# takes 128-197 registers without spills and keeps three K/V tiles in flight (16 rows: two;
# bench/results/20261207-aot-attention-rows.txt). Unmeasured on a GPU: bench/gpu_check.sh
# times both on decode and prefill, against torch's SDPA.
TILE_ROWS = 16


def _tile_sizes(group_size: int, head_dim: int, rows: int = TILE_ROWS
                ) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N) from the model's shapes only, never from the batch."""
    block_m = max(rows, triton.next_power_of_2(group_size))
    block_q = block_m // group_size
    block_n = 64 if head_dim <= 128 else 32
    return block_q, block_m, block_n


def is_decode_step(num_tokens: int, num_seqs: int, max_query_len: int | None) -> bool:
    """One token a sequence, as the host knows from its bound on query lengths."""
    return max_query_len == 1 and num_tokens == num_seqs


def prefill_tiles(head_dim: int, dtype: torch.dtype, rows: int = TILE_ROWS) -> int:
    """Query tiles a prefill program holds, reading each K/V tile once for all of them: as
    many as sm_90/sm_80 code keeps in registers without spilling (aot.py, 16-bit operands: at
    head_dim 64, 2 tiles of 16 rows take 142-196 registers and 4 tiles 238-255 with spills,
    2 of 64 rows spill; at 256, 2 tiles take 238-255; fp32 operands spill at 2 tiles)."""
    return 2 if dtype != torch.float32 and head_dim <= 128 and rows <= 16 else 1


def sub_tiles(num_tokens: int, num_seqs: int, max_query_len: int | None, block_q: int,
              head_dim: int, dtype: torch.dtype, rows: int = TILE_ROWS) -> int:
    """Query tiles a program holds: one in a decode step and where no sequence brings a full
    program of queries (or the host does not know), prefill_tiles otherwise. Any choice gives
    each row the same bits (kernels/attention_tile.py)."""
    tiles = prefill_tiles(head_dim, dtype, rows)
    if max_query_len is None or is_decode_step(num_tokens, num_seqs, max_query_len) \
            or max_query_len < tiles * block_q:
        return 1
    return tiles


def query_programs(num_tokens: int, num_seqs: int, max_query_len: int | None,
                   block_q: int, tiles: int = 1) -> int:
    """The grid's first axis: a program per sequence in a decode step, otherwise room for
    every sequence's position-aligned programs of `tiles` query tiles."""
    if is_decode_step(num_tokens, num_seqs, max_query_len):
        return num_seqs
    return num_tokens // (block_q * tiles) + 2 * num_seqs


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
    tiles: int | None = None,  # query tiles a prefill program holds (1, 2, 4; sub_tiles's)
    rows: int = TILE_ROWS,  # query rows a tile (the bench times others; one per model)
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
    block_q, block_m, block_n = _tile_sizes(group_size, head_dim, rows)
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
    if tiles is None:
        tiles = sub_tiles(num_tokens, num_seqs, max_query_len, block_q, head_dim,
                          query.dtype, rows)
    assert tiles in (1, 2, 4) and not (decode and tiles > 1), tiles
    grid = (query_programs(num_tokens, num_seqs, max_query_len, block_q, tiles), num_kv_heads,
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
        PARTITION_SIZE=partition_size, SPLIT=split, DECODE=decode, SUB_TILES=tiles,
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

