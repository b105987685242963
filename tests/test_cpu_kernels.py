"""kiln's CPU kernels (kiln/runtime/backends/cpu/csrc) against independent oracles: the gguf
package's dequantization (bit for bit), fp64 products of it, the torch reference of the paged
attention (kernels/attention.py), torch's norms and activations; and their invariance: a row
gives the same bits whatever the batch, the chunk, the thread count or the instruction set."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import quants

from kiln.kernels.attention_ref import paged_attention_ref
from kiln.runtime.backends import RopeTable
from kiln.runtime.backends.cpu import library
from kiln.runtime.backends.cpu.backend import CpuBackend, PackedLinear
from kiln.runtime.backends.cpu.packing import BLOCK_BYTES, SB, pack
from kiln.runtime.kv.attention_metadata import AttentionMetadata
from kiln.runtime.store.gguf_file import WeightSource

QUANTIZED = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
FLOATS = [Q.F32, Q.F16, Q.BF16]
HAS_AVX512 = "avx512f" in library._cpu_flags().split()


@pytest.fixture(scope="module")
def be():
    return CpuBackend()


def _raw(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """A GGUF tensor's rows, [rows, row bytes]: quantized by the gguf package where it can,
    else random blocks with realistic (small, positive) fp16 scales."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.05)
    if qtype == Q.F32:
        return w.view(np.uint8)
    if qtype == Q.F16:
        return w.astype(np.float16).view(np.uint8)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.BF16):
        return np.ascontiguousarray(quants.quantize(w, qtype)).view(np.uint8).reshape(rows, -1)
    nsb = cols // SB[qtype]
    raw = rng.integers(0, 256, size=(rows, nsb, BLOCK_BYTES[qtype]), dtype=np.uint8)
    d = (rng.random((rows, nsb)) * 1e-3).astype(np.float16).view(np.uint8).reshape(rows, nsb, 2)
    if qtype == Q.Q6_K:
        raw[..., 208:210] = d
    else:
        raw[..., 0:2], raw[..., 2:4] = d, d
    return raw.reshape(rows, -1)


def _source(qtype, rows, cols, seed) -> WeightSource:
    return WeightSource("w", qtype, rows, cols, _raw(qtype, rows, cols, seed))


@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS, ids=lambda q: q.name)
def test_dequantized_packed_weights_are_the_gguf_packages_bit_for_bit(be, qtype):
    rows, cols = 40, 512  # a ragged last group of 16 rows, two K-quant super-blocks
    src = _source(qtype, rows, cols, 0)
    packed = pack(src.raw_bytes(), qtype, cols)
    assert packed.shape[1] == be.lib.kiln_group_bytes(int(qtype), cols)
    out = np.zeros((rows, cols), np.float32)
    be.lib.kiln_dequant(int(qtype), packed.ctypes.data, rows, cols, out.ctypes.data)
    np.testing.assert_array_equal(out.view(np.uint32), src.dequantize().view(np.uint32))


@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 37, 250])
def test_products_match_fp64_of_the_dequantized_weights(be, qtype, rows):
    # stacked, as qkv is; 19 groups of 16 rows: decode steps (1 or 2 rows) take their first 16
    # through the fused path, the rest through the tiles, as prefill chunks do
    srcs = [_source(qtype, 256, 512, 1), _source(qtype, 40, 512, 2)]
    w = PackedLinear(srcs, None, be.lib, be.threads)
    x = torch.from_numpy(np.random.default_rng(rows).standard_normal((rows, 512), np.float32))
    y = w(x)
    ref = x.double() @ torch.from_numpy(np.concatenate([s.dequantize() for s in srcs])).double().T
    assert y.dtype == torch.float32 and y.shape == (rows, 296)
    # fp32 sums of 512 products: the error of any fp32 order of additions
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-5 * ref.abs().max().item())


def test_mixed_types_stack_and_bias_is_added(be):
    srcs = [_source(Q.Q5_0, 48, 256, 3), _source(Q.Q8_0, 16, 256, 4), _source(Q.Q6_K, 32, 256, 5)]
    bias = np.random.default_rng(0).standard_normal(96).astype(np.float32)
    w = be.linear(srcs, bias)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    dense = torch.from_numpy(np.concatenate([s.dequantize() for s in srcs]))
    torch.testing.assert_close(w(x), F.linear(x, dense, torch.from_numpy(bias)), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K, Q.F16], ids=lambda q: q.name)
def test_a_row_gives_the_same_bits_whatever_the_batch_and_threads(qtype):
    src = _source(qtype, 600, 1536, 6)  # enough groups for the fused path (up to 6 rows)
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((300, 1536), np.float32))
    two = CpuBackend(threads=2).linear([src])
    full = two(x)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 5), slice(0, 3), slice(2, 6), slice(9, 14),
                 slice(4, 10), slice(0, 7), slice(13, 29), slice(1, 300)):
        assert torch.equal(two(x[rows].contiguous()), full[rows])
    one = CpuBackend(threads=1).linear([src])
    assert torch.equal(one(x[:9].contiguous()), full[:9])
    assert torch.equal(CpuBackend(threads=3).linear([src])(x), full)


@pytest.mark.skipif(not HAS_AVX512, reason="needs AVX-512 to compare with the AVX2 build")
def test_the_avx2_build_gives_the_avx512_builds_bits():
    src = _source(Q.Q4_K, 320, 512, 7)  # 20 groups: decode rows take the fused path
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(1))
    h = torch.randn(11, 192, generator=torch.Generator().manual_seed(2)) * 3
    w = torch.rand(64) + 0.5

    def outputs(backend):
        linear = backend.linear([src])
        return (linear(x), linear(x[:1]), backend.rms_norm(h.view(33, 64), w, 1e-6),
                backend.act_mul(h[:, :128].contiguous(), "silu"),
                backend.act_mul(h[:, :128].contiguous(), "gelu_tanh"))

    avx2, avx512 = outputs(CpuBackend(extra_flags=("-mno-avx512f",))), outputs(CpuBackend())
    for a, b in zip(avx2, avx512, strict=True):
        assert torch.equal(a, b)


# --- products on 8-bit activations (csrc/linear_i8.c) ------------------------------------------


def _int8(srcs, threads=2, flags=()):
    backend = CpuBackend(threads=threads, extra_flags=flags, int8_products=True)
    w = backend.linear(srcs)
    assert w.int8
    return w


def _exact_in_8_bits(rows: int, cols: int, seed: int) -> torch.Tensor:
    """x that rounding to 8 bits per run of 16 keeps exactly: n * 2^e, |n| <= 127, a 127 in
    every run."""
    rng = np.random.default_rng(seed)
    n = rng.integers(-127, 128, size=(rows, cols))
    n[:, ::16] = 127
    scale = 2.0 ** rng.integers(-9, 0, size=(rows, cols // 16)).repeat(16, axis=1)
    return torch.from_numpy((n * scale).astype(np.float32))


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 37])
def test_int8_products_are_fp64_products_where_rounding_x_loses_nothing(qtype, rows):
    # stacked, with a ragged last group; every tile shape (1-4 rows) and the group tails
    srcs = [_source(qtype, 256, 512, 1), _source(qtype, 40, 512, 2)]
    x = _exact_in_8_bits(rows, 512, rows)
    ref = x.double() @ torch.from_numpy(np.concatenate([s.dequantize() for s in srcs])).double().T
    y = _int8(srcs)(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 296)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-5 * ref.abs().max().item())


def _largest(qtype: Q, rows: int, cols: int) -> WeightSource:
    """Every quant at its largest magnitude (Q8_0's at -128), every scale 2^-10."""
    nb = cols // SB[qtype]
    raw = np.full((rows, nb, BLOCK_BYTES[qtype]), 0x80 if qtype == Q.Q8_0 else 0xFF, np.uint8)
    d = np.full((rows, nb), 2.0 ** -10, np.float16).view(np.uint8).reshape(rows, nb, 2)
    scales = {Q.Q4_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}.get(qtype, (0,))
    for at in scales:
        raw[..., at:at + 2] = d
    return WeightSource("w", qtype, rows, cols, raw.reshape(rows, -1))


@pytest.mark.parametrize("flags", [(), ("-mno-avx512f",)], ids=["native", "avx2"])
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_int8_products_hold_at_the_largest_quants_and_activations(qtype, flags):
    # Without VNNI (the AVX2 build, and AVX-512 before it) the kernel adds quads' 16-bit pair
    # sums before widening them: the bound it relies on is met here with no room to spare
    # (x at +-127 in every lane).
    src = _largest(qtype, 48, 512)
    x = torch.full((2, 512), 127 * 2.0 ** -4)
    x[1] = -x[1]
    ref = x.double() @ torch.from_numpy(src.dequantize()).double().T
    y = _int8([src], flags=flags)(x)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-5 * ref.abs().max().item())


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_int8_products_err_by_no_more_than_rounding_x_to_8_bits(qtype):
    src = _source(qtype, 96, 512, 3)
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((7, 512), np.float32))
    w = torch.from_numpy(src.dequantize()).double()
    # |x - round(x)| <= d / 2 per element, d = max|x| / 127 over its run of 16
    half_step = (x.abs().view(7, 32, 16).amax(-1) / 127 / 2).repeat_interleave(16, -1).double()
    bound = half_step @ w.abs().T
    err = (_int8([src])(x).double() - x.double() @ w.T).abs()
    assert (err <= bound * 1.0001 + 1e-5).all()
    assert err.max() > 0  # x was rounded: the fp32 products would not match this


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_int8_rows_give_the_same_bits_whatever_the_batch_threads_and_isa(qtype):
    src = _source(qtype, 200, 768, 6)
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((41, 768), np.float32))
    full = _int8([src])(x)
    two = _int8([src])
    for rows in (slice(0, 1), slice(5, 6), slice(3, 5), slice(2, 9), slice(4, 10), slice(1, 41)):
        assert torch.equal(two(x[rows].contiguous()), full[rows])
    assert torch.equal(_int8([src], threads=1)(x), full)
    assert torch.equal(_int8([src], threads=3)(x[:6].contiguous()), full[:6])
    if HAS_AVX512:
        assert torch.equal(_int8([src], flags=("-mno-avx512f",))(x), full)


def test_int8_rows_of_a_part_no_cache_holds_give_the_same_bits_at_any_batch():
    """Such a part (an LM head: over 8 MB) takes tiles of one group up to 31 rows and of
    several from 32: the rows' bits are the same either way."""
    src = _source(Q.Q8_0, 16384, 512, 8)  # 8.9 MB packed
    x = torch.from_numpy(np.random.default_rng(9).standard_normal((40, 512), np.float32))
    linear = _int8([src])
    full = linear(x)
    for rows in (slice(0, 1), slice(3, 8), slice(10, 41)):
        assert torch.equal(linear(x[rows].contiguous()), full[rows])
    if HAS_AVX512:
        assert torch.equal(_int8([src], flags=("-mno-avx512f",))(x[:5].contiguous()), full[:5])


def test_int8_leaves_float_weights_and_ragged_k_on_the_fp32_products():
    assert not CpuBackend(int8_products=True).linear([_source(Q.F16, 32, 512, 0)]).int8
    mixed = [_source(Q.Q8_0, 16, 256, 0), _source(Q.F32, 16, 256, 1)]
    assert not CpuBackend(int8_products=True).linear(mixed).int8
    with pytest.raises(ValueError, match="no i8 layout"):
        pack(_source(Q.BF16, 16, 64, 0).raw_bytes(), Q.BF16, 64, "i8")


def test_reused_outputs_per_site_for_decode_rows_and_per_width_above():
    """outputs.py: a decode step's output (up to 16 rows) is the product's own buffer; a
    larger step's is one buffer the backend's products of that width share (read before the
    next of them runs), grown to the largest step; the LM head's logits are always new.
    Same values as a backend that allocates every output."""
    be, fresh = CpuBackend(int8_products=True, reuse_outputs=True), CpuBackend(int8_products=True)
    srcs = [_source(Q.Q8_0, 64, 256, 0), _source(Q.Q4_K, 64, 256, 1)]
    a, b = be.linear(srcs[:1]), be.linear(srcs[1:])
    other = be.linear([_source(Q.Q8_0, 32, 256, 2)])  # another width: its own buffer
    head = be.lm_head(None, srcs[0])
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(3))
    for rows in (40, 4):
        ya = a(x[:rows])
        at, ya = ya.data_ptr(), ya.clone()  # b's output may take its place
        yb, yo = b(x[:rows]), other(x[:rows])
        assert (at == yb.data_ptr()) == (rows > 16)
        assert yo.data_ptr() not in (at, yb.data_ptr())
        assert torch.equal(ya, fresh.linear(srcs[:1])(x[:rows]))
        assert torch.equal(yb, fresh.linear(srcs[1:])(x[:rows]))
    assert a(x[:24]).data_ptr() == a(x[:40]).data_ptr()  # a smaller step: a view of the same
    assert head(x).data_ptr() != head(x).data_ptr()


def test_embedding_rows_are_the_dequantized_rows(be):
    src = _source(Q.Q8_0, 100, 576, 8)
    emb = be.embedding(src)
    ids = torch.tensor([0, 99, 17, 17, 64])
    np.testing.assert_array_equal(emb(ids).numpy(), src.dequantize()[ids.numpy()])


# --- row-wise operations ----------------------------------------------------------------------


def test_rms_norm_matches_torch(be):
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(0)) * 3
    w = torch.rand(576) + 0.5
    torch.testing.assert_close(be.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5),
                               atol=1e-6, rtol=1e-6)
    heads = torch.randn(5, 10, 256, generator=torch.Generator().manual_seed(1))
    qk = heads[:, :6]  # a view, as Q and K are inside the fused product
    want = F.rms_norm(qk, (256,), w[:256], 1e-6)
    be.rms_norm_heads_(qk, w[:256].contiguous(), 1e-6)
    torch.testing.assert_close(heads[:, :6], want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activations_match_torch(be, activation):
    gu = torch.randn(9, 2 * 1000, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = gu.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    torch.testing.assert_close(be.act_mul(gu, activation), act * up, atol=2e-6, rtol=2e-6)


def test_rope_matches_rotate_half(be):
    rope = RopeTable(64, 4096, 10000.0, "cpu")
    x = torch.randn(6, 12, 64, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 1, 5, 100, 2047, 4095])
    cos, sin = rope.cos[pos][:, None], rope.sin[pos][:, None]
    x1, x2 = x[..., :32], x[..., 32:]
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    be.rope_(x, pos, rope)
    torch.testing.assert_close(x, want, atol=1e-6, rtol=1e-6)


# --- paged attention --------------------------------------------------------------------------

NB, BS = 200, 16


@pytest.fixture(scope="module", params=[False, True], ids=["kv-fp32", "kv-fp16"])
def kv_be(request):
    """The backend with each KV cache dtype: fp16 caches hold K/V rounded to fp16, which the
    kernel reads back exactly, so the oracle is the reference on the rounded K/V."""
    return CpuBackend(kv_fp16=request.param)


def _attention_case(be, seqs, H, KVH, D, seed=0):
    """seqs: (seq_len, query_len) each. K/V for every position are written through the
    backend's store and also into the reference's layout; blocks are scrambled."""
    g = torch.Generator().manual_seed(seed)
    kc, vc = be.kv_cache(NB, BS, KVH, D)
    ref_k, ref_v = torch.zeros(NB, BS, KVH, D), torch.zeros(NB, BS, KVH, D)
    perm = torch.randperm(NB, generator=g).int()
    tables = torch.zeros(len(seqs), 40, dtype=torch.int32)
    at, qs = 0, [0]
    for i, (L, ql) in enumerate(seqs):
        nb = -(-L // BS)
        tables[i, :nb] = perm[at:at + nb]
        at += nb
        k, v = torch.randn(L, KVH, D, generator=g), torch.randn(L, KVH, D, generator=g)
        slots = torch.tensor([int(tables[i, p // BS]) * BS + p % BS for p in range(L)])
        stored = (k.half().float(), v.half().float()) if be.kv_fp16 else (k, v)
        ref_k.view(-1, KVH, D)[slots], ref_v.view(-1, KVH, D)[slots] = stored
        be.lib.kiln_store_kv(k.data_ptr(), KVH * D, v.data_ptr(), KVH * D, slots.data_ptr(), L,
                             KVH, D, kc.data_ptr(), vc.data_ptr(), be.kv_fp16)
        qs.append(qs[-1] + ql)
    q = torch.randn(qs[-1], H, D, generator=g)
    return q, (kc, vc), (ref_k, ref_v), tables, torch.tensor([L for L, _ in seqs],
                                                             dtype=torch.int32), qs


def _attend(be, q, cache, tables, seq_lens, qs, window=0):
    """The kernel on a batch whose keys are all in the cache already."""
    H, D = q.shape[1], q.shape[2]
    out = torch.empty(q.shape[0], H * D)
    query_start_loc = torch.tensor(qs, dtype=torch.int32)  # alive until the call returns
    be.lib.kiln_attention(q.data_ptr(), H * D, D, cache[0].data_ptr(), cache[1].data_ptr(),
                          tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(),
                          query_start_loc.data_ptr(), len(qs) - 1, H,
                          cache[0].shape[1], D, D ** -0.5, window, out.data_ptr(), H * D, D,
                          be.kv_fp16, be.threads)
    return out.view(q.shape)


# (seq_len, query_len): a chunk after cached context, decodes, a whole prompt, one token
MIXED = [(337, 37), (129, 1), (17, 1), (50, 50), (1, 1), (256, 1)]


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 256), (14, 2, 64)],
                         ids=["smollm2", "gemma3", "qwen2.5"])
@pytest.mark.parametrize("window", [0, 24, 100])
def test_attention_matches_the_reference_on_a_mixed_batch(kv_be, heads, window):
    H, KVH, D = heads
    q, cache, ref_cache, tables, seq_lens, qs = _attention_case(kv_be, MIXED, H, KVH, D)
    got = _attend(kv_be, q, cache, tables, seq_lens, qs, window)
    ref = paged_attention_ref(q, *ref_cache, tables, seq_lens, torch.tensor(qs, dtype=torch.int32),
                              D ** -0.5, sliding_window=window)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(not HAS_AVX512, reason="needs AVX-512 to compare with the AVX2 build")
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 256), (5, 1, 80)],
                         ids=["smollm2", "gemma3", "five-vectors"])
@pytest.mark.parametrize("seqs", ["mixed", "many"])
def test_attention_in_the_avx2_build_gives_the_avx512_builds_bits(heads, seqs):
    """The AVX2 build's register tiles are smaller (16 ymm), and a head of five vectors ends
    on a narrower tile: each score and output lane is still the same chain of operations."""
    H, KVH, D = heads
    builds = (CpuBackend(kv_fp16=True, threads=2),
              CpuBackend(kv_fp16=True, threads=2, extra_flags=("-mno-avx512f",)))
    q, cache, ref_cache, tables, seq_lens, qs = _attention_case(
        builds[0], MIXED if seqs == "mixed" else MANY, H, KVH, D)
    native, avx2 = (_attend(be, q, cache, tables, seq_lens, qs, 24) for be in builds)
    assert torch.equal(avx2, native)
    ref = paged_attention_ref(q, *ref_cache, tables, seq_lens, torch.tensor(qs, dtype=torch.int32),
                              D ** -0.5, sliding_window=24)
    torch.testing.assert_close(avx2, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 24])
def test_attention_rows_do_not_depend_on_chunking_or_neighbours(kv_be, window):
    q, cache, _, tables, seq_lens, qs = _attention_case(kv_be, MIXED, 9, 3, 64)
    full = _attend(kv_be, q, cache, tables, seq_lens, qs, window)

    def one(rows, table, seq_len):
        return _attend(kv_be, q[rows].contiguous(), cache, table[None].contiguous(),
                       torch.tensor([seq_len], dtype=torch.int32), [0, rows.stop - rows.start],
                       window)

    # Sequence 0's chunk (positions 300..336) as a decode of its last row, of a middle row,
    # and as a shorter chunk; a decode row alone as beside the others.
    assert torch.equal(one(slice(36, 37), tables[0], 337)[0], full[36])
    assert torch.equal(one(slice(10, 11), tables[0], 311)[0], full[10])
    assert torch.equal(one(slice(20, 37), tables[0], 337), full[20:37])
    assert torch.equal(one(slice(37, 38), tables[1], 129)[0], full[37])
    # A whole prompt read in one chunk, against the same rows as decodes.
    for pos in (0, 15, 16, 49):
        assert torch.equal(one(slice(39 + pos, 40 + pos), tables[3], pos + 1)[0], full[39 + pos])


# Many sequences of one position tile each (decode rows, drafted tokens) and one longer
# chunk: past 4 per thread, a sequence of one tile is one unit of all its kv heads
MANY = [(129, 1), (17, 1), (300, 5), (1, 1), (256, 1), (64, 16), (65, 1), (90, 3),
        (337, 37), (33, 1), (16, 1), (200, 2)]


@pytest.mark.parametrize("heads", [(9, 3, 64), (14, 2, 64)], ids=["smollm2", "qwen2.5"])
@pytest.mark.parametrize("window", [0, 24])
def test_attention_of_many_sequences_gives_each_row_its_own_bits(kv_be, heads, window):
    H, KVH, D = heads
    be = CpuBackend(kv_fp16=kv_be.kv_fp16, threads=2)
    q, cache, ref_cache, tables, seq_lens, qs = _attention_case(be, MANY, H, KVH, D)
    full = _attend(be, q, cache, tables, seq_lens, qs, window)
    ref = paged_attention_ref(q, *ref_cache, tables, seq_lens, torch.tensor(qs, dtype=torch.int32),
                              D ** -0.5, sliding_window=window)
    torch.testing.assert_close(full, ref, atol=2e-6, rtol=1e-5)
    for i, (L, ql) in enumerate(MANY):  # each sequence alone: units of one kv head
        rows = slice(qs[i], qs[i + 1])
        alone = _attend(be, q[rows].contiguous(), cache, tables[i][None].contiguous(),
                        torch.tensor([L], dtype=torch.int32), [0, ql], window)
        assert torch.equal(alone, full[rows]), f"sequence {i}"


def test_backend_attention_stores_through_the_slot_mapping(kv_be):
    """The backend's rope_store_kv() writes this step's K/V where the slot mapping says (-1:
    nowhere), rounded to the cache's dtype, and attention() then reads them back."""
    be = kv_be
    H, KVH, D = 4, 2, 64
    kc, vc = be.kv_cache(8, BS, KVH, D)
    assert kc.dtype == vc.dtype == (torch.float16 if be.kv_fp16 else torch.float32)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, (H + 2 * KVH) * D, generator=g)
    q = qkv[:, :H * D].view(3, H, D)
    k = qkv[:, H * D:(H + KVH) * D].view(3, KVH, D)
    v = qkv[:, (H + KVH) * D:].view(3, KVH, D)
    table = torch.tensor([[5, 2]], dtype=torch.int32)
    slots = torch.tensor([5 * 16 + 0, 5 * 16 + 1, 5 * 16 + 2])
    meta = AttentionMetadata(torch.tensor([0, 3], dtype=torch.int32),
                             torch.tensor([3], dtype=torch.int32), table, slots, 3, 3)
    # at position 0 RoPE turns nothing: what is stored is k itself
    be.rope_store_kv(q, k, v, (kc, vc), slots, torch.zeros(3, dtype=torch.int64),
                     RopeTable(D, 4, 10000.0, "cpu"))
    out = be.attention(q, (kc, vc), meta, D ** -0.5, 0)
    assert torch.equal(kc[5, :, :, :3].permute(2, 0, 1), k.to(kc.dtype))
    assert torch.equal(vc[5, :, :3].permute(1, 0, 2), v.to(vc.dtype))
    assert kc[2].abs().sum() == 0 and vc[:5].abs().sum() == 0
    ref_k, ref_v = torch.zeros(8, BS, KVH, D), torch.zeros(8, BS, KVH, D)
    ref_k[5, :3], ref_v[5, :3] = k.to(kc.dtype).float(), v.to(vc.dtype).float()
    ref = paged_attention_ref(q, ref_k, ref_v, table, meta.seq_lens, meta.query_start_loc,
                              D ** -0.5)
    torch.testing.assert_close(out.view(3, H, D), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("flags", [(), ("-mno-avx512f",)], ids=["native", "avx2"])
def test_the_c_philox_stream_is_the_samplers_bit_for_bit(flags):
    """csrc/philox.c against philox_uniform_ref (itself Triton's tl.rand bit for bit, see
    test_sampling_kernel.py): any seed (negative ones too), steps past 32 bits, any token."""
    from kiln.kernels.sampling_ref import philox_uniform_ref

    g = torch.Generator().manual_seed(3)
    n = 40000
    seeds = torch.randint(-2**63, 2**63 - 1, (n,), dtype=torch.int64, generator=g)
    steps = torch.randint(0, 2**40, (n,), dtype=torch.int64, generator=g)
    tokens = torch.randint(0, 262144, (n,), dtype=torch.int64, generator=g)
    seeds[:4], steps[:4], tokens[:4] = torch.tensor([0, -1, 1, 2**62]), 0, 0
    out = torch.empty(n, dtype=torch.float32)
    library.load(flags).kiln_philox_uniform(seeds.data_ptr(), steps.data_ptr(),
                                            tokens.data_ptr(), n, out.data_ptr(), 3)
    ref = philox_uniform_ref(seeds, steps, tokens)
    assert torch.equal(out, ref)
    assert 0.0 <= out.min() and out.max() < 1.0 and abs(out.mean().item() - 0.5) < 0.01
