"""Paged attention: the Triton kernel against the torch reference, the reference against a
dense oracle, the sliding-window convention, and bit-exact invariance to chunking/batching."""

from dataclasses import dataclass

import pytest
import torch
from conftest import DEVICES

from kiln.kernels import BLOCK_SIZE
from kiln.kernels.attention import paged_attention, query_programs
from kiln.kernels.attention_ref import paged_attention_ref

# (atol, rtol) of the kernel against the fp32-accumulating reference. bf16/fp16: the kernel
# rounds P to the cache dtype before P @ V (as on tensor cores) and rounds its output.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}

# (context_len, query_len) per sequence. Context lengths 1, 15, 16, 17, 255 sit one short of,
# on, and one past a KV block boundary; prefill chunks have cached context before them.
DECODE = [(1, 1), (15, 1), (16, 1), (17, 1), (255, 1)]
PREFILL = [(0, 17), (15, 20), (16, 16), (17, 33), (255, 9)]
MIXED = [(255, 1), (0, 17), (1, 1), (15, 20), (17, 1), (16, 16), (15, 1), (255, 9), (16, 1)]

GQA = {1: (2, 2), 3: (6, 2), 4: (4, 1), 8: (8, 1)}  # group size -> (num_heads, num_kv_heads)


@dataclass
class PagedSequences:
    """Whole sequences in a scrambled paged cache, plus their contiguous K/V and queries."""

    key_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, -1 padded
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    queries: list[torch.Tensor]  # per sequence [seq_len, num_heads, head_dim]

    def step(self, rows: list[tuple[int, int, int]]) -> tuple:
        """Attention args for one launch of (seq_id, context_len, query_len) rows."""
        device = self.key_cache.device
        query = torch.cat([self.queries[s][c:c + q] for s, c, q in rows])
        ids = torch.tensor([s for s, _, _ in rows], device=device)
        seq_lens = torch.tensor([c + q for _, c, q in rows], dtype=torch.int32, device=device)
        query_start_loc = torch.tensor([0] + [q for _, _, q in rows], device=device).cumsum(0)
        return (query, self.key_cache, self.value_cache, self.block_tables[ids].contiguous(),
                seq_lens, query_start_loc.to(torch.int32))


def make_sequences(seq_lens, num_heads, num_kv_heads, head_dim, dtype, device, seed=0,
                   spare_blocks=3) -> PagedSequences:
    """Physical blocks are a random permutation (non-contiguous, out of order); every cache
    slot that holds no token is NaN, so any read past a sequence's length poisons the output."""
    gen = torch.Generator().manual_seed(seed)
    num_seq_blocks = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in seq_lens]
    num_blocks = sum(num_seq_blocks) + spare_blocks
    physical = torch.randperm(num_blocks, generator=gen).split(num_seq_blocks + [spare_blocks])
    shape = (num_blocks * BLOCK_SIZE, num_kv_heads, head_dim)
    flat_k = torch.full(shape, float("nan"), dtype=dtype)
    flat_v = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(seq_lens), max(num_seq_blocks)), -1, dtype=torch.int32)
    keys, values, queries = [], [], []
    for i, n in enumerate(seq_lens):
        keys.append(torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype))
        values.append(torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype))
        queries.append(torch.randn(n, num_heads, head_dim, generator=gen).to(dtype))
        block_tables[i, :num_seq_blocks[i]] = physical[i].int()
        pos = torch.arange(n)
        slots = physical[i][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        flat_k[slots], flat_v[slots] = keys[i], values[i]
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    return PagedSequences(
        flat_k.view(cache_shape).to(device), flat_v.view(cache_shape).to(device),
        block_tables.to(device), [k.to(device) for k in keys], [v.to(device) for v in values],
        [q.to(device) for q in queries])


def make_step(batch, num_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    seqs = make_sequences([c + q for c, q in batch], num_heads, num_kv_heads, head_dim, dtype,
                          device, seed)
    return seqs, seqs.step([(i, c, q) for i, (c, q) in enumerate(batch)])


def assert_close(actual, expected, atol, rtol):
    """torch.testing.assert_close, also naming the first mismatching (token, head, dim)."""
    def first_mismatch(msg):
        bad = ~torch.isclose(actual.float(), expected.float(), atol=atol, rtol=rtol)
        idx = tuple(bad.nonzero()[0].tolist()) if bad.any() else None
        return f"{msg}\nfirst mismatch at (token, head, dim) = {idx}"

    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=first_mismatch)


# An L9 orthogonal array over (dtype, head_dim, GQA group, sliding window): every pair of
# levels of any two axes appears once, on the mixed decode + prefill batch.
L9 = [(0, 0, 0, 0), (0, 1, 1, 1), (0, 2, 2, 2), (1, 0, 1, 2), (1, 1, 2, 0), (1, 2, 0, 1),
      (2, 0, 2, 1), (2, 1, 0, 2), (2, 2, 1, 0)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEAD_DIMS = [64, 128, 256]
GROUPS = [1, 3, 8]
WINDOWS = [0, 20, 100]
KERNEL_CASES = [
    pytest.param(MIXED, DTYPES[d], HEAD_DIMS[h], GROUPS[g], WINDOWS[w],
                 id=f"mixed-{str(DTYPES[d])[6:]}-d{HEAD_DIMS[h]}-gqa{GROUPS[g]}-w{WINDOWS[w]}")
    for d, h, g, w in L9
] + [
    pytest.param(DECODE * 3, torch.bfloat16, 64, 3, 0, id="decode15-smollm2-bf16"),
    pytest.param(DECODE, torch.float32, 128, 8, 20, id="decode-fp32-d128-gqa8-w20"),
    pytest.param(PREFILL, torch.bfloat16, 256, 4, 20, id="prefill-gemma3-bf16-w20"),
    pytest.param(PREFILL, torch.float16, 64, 1, 0, id="prefill-fp16-d64-mha"),
    pytest.param(MIXED, torch.float32, 80, 3, 20, id="mixed-fp32-d80-padded-w20"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch, dtype, head_dim, group, window", KERNEL_CASES)
def test_kernel_matches_reference(batch, dtype, head_dim, group, window, device):
    num_heads, num_kv_heads = GQA[group]
    _, args = make_step(batch, num_heads, num_kv_heads, head_dim, dtype, device)
    scale = head_dim ** -0.5
    out = paged_attention(*args, scale=scale, sliding_window=window)
    ref = paged_attention_ref(*args, scale=scale, sliding_window=window)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, ref, atol, rtol)


# Split-KV: partitions of 64 keys (the smallest the tiles allow) cut these sequences into up
# to 5 partitions, so the reduction, the window's first partition and the one-partition rows
# of a split launch are all exercised at shapes the interpreter runs quickly.
SPLIT_CASES = [
    pytest.param(MIXED, torch.float32, 64, 3, 0, id="mixed-fp32-d64-gqa3"),
    pytest.param(MIXED, torch.bfloat16, 128, 8, 100, id="mixed-bf16-d128-gqa8-w100"),
    pytest.param(DECODE * 2, torch.float16, 64, 1, 100, id="decode-fp16-d64-mha-w100"),
    pytest.param(PREFILL, torch.float32, 256, 4, 0, id="prefill-fp32-d256-gqa4"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch, dtype, head_dim, group, window", SPLIT_CASES)
def test_split_kv_matches_reference(batch, dtype, head_dim, group, window, device):
    num_heads, num_kv_heads = GQA[group]
    _, args = make_step(batch, num_heads, num_kv_heads, head_dim, dtype, device)
    scale = head_dim ** -0.5
    partition = 64 if head_dim <= 128 else 32
    out = paged_attention(*args, scale=scale, sliding_window=window, partition_size=partition)
    ref = paged_attention_ref(*args, scale=scale, sliding_window=window)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, ref, atol, rtol)


@pytest.mark.parametrize("device", DEVICES)
def test_split_kv_row_of_one_partition_is_bit_identical_to_unsplit(device):
    """A 40-token sequence fits one 64-key partition: batched beside a 300-token one (a split
    launch, through the reduction) it must equal its unsplit launch bit for bit."""
    seqs = make_sequences([40, 300], 9, 3, 64, torch.bfloat16, device)
    alone = paged_attention(*seqs.step([(0, 0, 40)]), scale=0.125, partition_size=64)
    split = paged_attention(*seqs.step([(1, 290, 10), (0, 0, 40)]), scale=0.125,
                            partition_size=64)
    assert torch.equal(alone, split[10:])


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_reads_strided_query_and_writes_given_out(device):
    """query as a view into a packed QKV tensor; out= is filled in place and returned."""
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    _, (query, *rest) = make_step(MIXED, num_heads, num_kv_heads, head_dim, torch.float32, device)
    qkv = torch.zeros(query.shape[0], num_heads + 2 * num_kv_heads, head_dim, device=device)
    qkv[:, :num_heads] = query
    out = torch.empty_like(query)
    result = paged_attention(qkv[:, :num_heads], *rest, scale=0.125, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out, paged_attention(query, *rest, scale=0.125))


def dense_attention(q, k, v, context_len, scale, window):
    """Oracle: dense causal softmax attention in float64 on contiguous K/V, K/V repeated per
    query head; the masks are transformers' own (causal_mask_function, sliding_window_overlay).

    q: [query_len, num_heads, head_dim]; k, v: [seq_len, num_kv_heads, head_dim].
    """
    masking = pytest.importorskip("transformers.masking_utils")
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_idx = torch.arange(context_len, context_len + q.shape[0], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[0], device=q.device)[None, :]
    allowed = masking.causal_mask_function(0, 0, q_idx, kv_idx)
    if window > 0:
        allowed = allowed & masking.sliding_window_overlay(window)(0, 0, q_idx, kv_idx)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_reference_matches_dense_oracle(group, window, dtype, device):
    num_heads, num_kv_heads = GQA[group]
    seqs, args = make_step(MIXED, num_heads, num_kv_heads, 64, dtype, device)
    ref = paged_attention_ref(*args, scale=0.125, sliding_window=window)
    # The reference computes in fp32; the only bf16 error is the rounding of its output.
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 8e-3)
    row = 0
    for i, (context_len, query_len) in enumerate(MIXED):
        q = seqs.queries[i][context_len:]
        expected = dense_attention(q, seqs.keys[i], seqs.values[i], context_len, 0.125, window)
        assert_close(ref[row:row + query_len], expected.to(dtype), atol, rtol)
        row += query_len


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attention", [paged_attention, paged_attention_ref])
def test_sliding_window_attends_last_w_positions_including_self(attention, device):
    """With all keys equal, attention is a uniform mean over the visible positions: V[t] = t
    makes the output that mean. Window W at position p must see p - W < t <= p."""
    window, seq_len, query_len = 5, 40, 4
    seqs = make_sequences([seq_len], 3, 1, 64, torch.float32, device)
    seqs.key_cache.zero_()
    for t in range(seq_len):
        block = seqs.block_tables[0, t // BLOCK_SIZE]
        seqs.value_cache[block, t % BLOCK_SIZE] = float(t)
    context_len = seq_len - query_len
    out = attention(*seqs.step([(0, context_len, query_len)]), scale=1.0, sliding_window=window)
    pos = torch.arange(context_len, seq_len, dtype=torch.float32, device=device)
    expected = (pos - (window - 1) / 2)[:, None, None].expand_as(out)
    assert_close(out, expected, 1e-5, 1e-5)
    # A window at least as long as the sequence is no window at all, bit for bit.
    args = seqs.step([(0, context_len, query_len)])
    assert torch.equal(attention(*args, scale=1.0, sliding_window=seq_len),
                       attention(*args, scale=1.0, sliding_window=0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("partition", [512, 64])
def test_kernel_rows_bit_identical_however_chunked_or_batched(partition, dtype, window, device):
    """Sequence 0 (75 tokens, prompt from scratch) computed as one chunk, as 2 and 3 chunks
    (the last one a decode step), and beside other sequences: its rows must be torch.equal.
    GQA 3 gives 5-position query tiles, so the chunk cuts fall mid-tile. With 64-key
    partitions its rows span one or two partitions and the launches split or not."""
    seqs = make_sequences([75, 18, 110], 9, 3, 64, dtype, device)
    call = lambda rows: paged_attention(*seqs.step(rows), scale=0.125, sliding_window=window,
                                        partition_size=partition)
    whole = call([(0, 0, 75)])
    two = torch.cat([call([(0, 0, 37)]), call([(0, 37, 38)])])
    three = torch.cat([call([(0, 0, 7)]), call([(0, 7, 67)]), call([(0, 74, 1)])])
    batched = call([(1, 17, 1), (0, 0, 75), (2, 100, 10)])[1:76]
    batched_chunks = torch.cat([call([(2, 0, 64), (0, 0, 37), (1, 3, 15)])[64:101],
                                call([(1, 17, 1), (2, 64, 46), (0, 37, 38)])[47:]])
    for name, other in [("two chunks", two), ("three chunks", three), ("batched", batched),
                        ("batched chunks", batched_chunks)]:
        assert torch.equal(whole, other), f"{name}: max diff {(whole - other).abs().max()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition", [512, 64])
def test_decode_grid_gives_the_general_grids_bits(partition, dtype, window, device):
    """A decode step's program per sequence (no search) against the general grid, and
    against the same rows inside a prefill chunk: torch.equal, split or not."""
    seqs = make_sequences([75, 18, 110, 5], 9, 3, 64, dtype, device)
    rows = [(0, 74, 1), (1, 17, 1), (2, 109, 1), (3, 4, 1)]
    call = lambda rows, **kw: paged_attention(*seqs.step(rows), scale=0.125,
                                              sliding_window=window, partition_size=partition,
                                              **kw)
    assert query_programs(4, 4, 1, block_q=5) == 4  # the decode grid is the one tested
    decode = call(rows, max_query_len=1)
    assert torch.equal(decode, call(rows))
    assert torch.equal(decode[[0]], call([(0, 70, 5)])[4:])  # the chunk's last row
    assert torch.equal(decode[[2]], call([(2, 109, 1)], max_query_len=1))


@pytest.mark.parametrize("device", DEVICES)
def test_reference_rows_independent_of_other_sequences(device):
    """The reference works one sequence at a time, so its batch neighbours cannot change it.
    (It is not bitwise chunking-invariant: matmul and softmax lengths change with the chunk.)"""
    seqs = make_sequences([75, 18, 110], 9, 3, 64, torch.float32, device)
    call = lambda rows: paged_attention_ref(*seqs.step(rows), scale=0.125, sliding_window=20)
    alone = call([(0, 37, 38)])
    assert torch.equal(alone, call([(1, 17, 1), (0, 37, 38), (2, 100, 10)])[1:39])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group, window, dtype, partition", [
    (3, 0, torch.float32, 512), (3, 20, torch.bfloat16, 64), (1, 0, torch.float16, 64),
    (4, 7, torch.float32, 64)])
def test_programs_of_several_query_tiles_give_each_row_its_bits(group, window, dtype,
                                                                partition, device):
    """A prefill program holding 2 or 4 query tiles (each K/V tile read once for all) against
    programs of one: torch.equal, for prompts from scratch and chunks starting mid-tile,
    beside decode rows and other chunks, split or not, with a window or not."""
    heads, kv_heads = GQA[group]
    seqs = make_sequences([75, 18, 110, 40], heads, kv_heads, 64, dtype, device)
    rows = [(0, 0, 75), (1, 17, 1), (2, 37, 73), (3, 3, 37)]
    call = lambda tiles: paged_attention(*seqs.step(rows), scale=0.125, sliding_window=window,
                                         partition_size=partition, max_seq_len=110,
                                         max_query_len=75, tiles=tiles)
    one = call(1)
    for tiles in (2, 4):
        assert torch.equal(one, call(tiles)), f"{tiles} tiles: max diff " \
            f"{(one - call(tiles)).abs().max()}"
    ref = paged_attention_ref(*seqs.step(rows), scale=0.125, sliding_window=window)
    assert_close(call(4), ref, *TOLERANCES[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group, window, dtype", [(3, 20, torch.bfloat16),
                                                  (4, 0, torch.float32)])
def test_tiles_of_64_rows_match_the_reference_and_keep_a_rows_bits(group, window, dtype,
                                                                   device):
    """Tiles of 64 query rows (one Hopper warpgroup's wgmma; 21 positions at GQA 3, 16 at 4)
    on every grid: against the reference on a mixed batch, and a row's bits the same however
    its prompt is chunked or batched, its last row the decode grid's."""
    heads, kv_heads = GQA[group]
    seqs = make_sequences([75, 18, 110], heads, kv_heads, 64, dtype, device)
    call = lambda rows, **kw: paged_attention(*seqs.step(rows), scale=0.125, rows=64,
                                              sliding_window=window, partition_size=64, **kw)
    mixed = [(1, 17, 1), (0, 0, 75), (2, 100, 10)]
    batched = call(mixed)
    assert_close(batched, paged_attention_ref(*seqs.step(mixed), scale=0.125,
                                              sliding_window=window), *TOLERANCES[dtype])
    whole = call([(0, 0, 75)])
    chunked = torch.cat([call([(0, 0, 7)]), call([(0, 7, 67)]),
                         call([(0, 74, 1)], max_query_len=1)])
    assert torch.equal(whole, chunked), (whole - chunked).abs().max()
    assert torch.equal(whole, batched[1:76])


def test_the_host_gives_prefill_programs_several_tiles_where_a_prompt_fills_them():
    from kiln.kernels.attention import prefill_tiles, sub_tiles
    bf16, block_q = torch.bfloat16, 5
    tiles = prefill_tiles(64, bf16)
    # what compiles without spills: head_dim 256 and fp32 operands keep one tile
    assert tiles > 1 and prefill_tiles(256, bf16) == prefill_tiles(64, torch.float32) == 1
    assert prefill_tiles(64, bf16, rows=64) == 1  # two 64-row tiles spill
    assert sub_tiles(4, 4, 1, block_q, 64, bf16) == 1  # a decode step: a program per sequence
    assert sub_tiles(300, 3, None, block_q, 64, bf16) == 1  # query lengths unknown
    assert sub_tiles(30, 3, tiles * block_q - 1, block_q, 64, bf16) == 1
    assert sub_tiles(300, 3, 256, block_q, 64, bf16) == tiles
    assert query_programs(300, 3, 256, block_q, tiles) == 300 // (tiles * block_q) + 6
