"""GGUF blocks -> the packed layout csrc/linear.c multiplies by.

The products want, for each k, the 16 weights of 16 consecutive rows as one vector. A GGUF
row is a run of blocks along k, so the blocks of 16 rows are interleaved here, once at load:
the same quants and the same scales, rearranged. For each group of 16 rows and each
super-block of SB weights along k (32, or 256 for the K-quants), in this order:

    Q4_0   d[16] f16                        | planes
    Q4_1   d[16] f16 | m[16] f16            | planes
    Q5_0   d[16] f16 | fifth bits[32] u16   | planes
    Q8_0   d[16] f16 | q[32][16] int8
    Q4_K   d[16] f16 | dmin[16] f16 | sc[8][16] u8 | min[8][16] u8 | planes
    Q5_K   as Q4_K                                                 | planes | fifth bits[256] u16
    Q6_K   d[16] f16 | sc[16][16] int8                             | planes | top bits[256] u32
    F32 / F16 / BF16: per k, the 16 rows' values

"planes": the low four bits of the quants, SB / 2 runs of 16 bytes, byte r of run p holding
row r's k = 2p in its low nibble and k = 2p + 1 in its high one. Fifth bits: bit r of a k's
u16 is row r's; Q6_K's top bits: bits 2r, 2r + 1 of a k's u32. The bytes per weight stay
the file's, or close (Q4_1 5 bits, Q5_0 5.5, Q8_0 8.5, Q4_K 4.6, Q6_K 6.6).

The quant and scale extraction follows the gguf package's own dequantization code; tests
check that csrc's dequantization of the packed weights gives its values bit for bit.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

# k per super-block, GGUF bytes per block
SB = {Q.Q4_0: 32, Q.Q4_1: 32, Q.Q5_0: 32, Q.Q8_0: 32, Q.Q4_K: 256, Q.Q5_K: 256, Q.Q6_K: 256,
      Q.F16: 1, Q.BF16: 1, Q.F32: 1}
BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q8_0: 34, Q.Q4_K: 144, Q.Q5_K: 176,
               Q.Q6_K: 210}
FLOAT_BYTES = {Q.F32: 4, Q.F16: 2, Q.BF16: 2}
SUPPORTED = frozenset(SB)
I8_TYPES = frozenset(BLOCK_BYTES)  # the types csrc/linear_i8.c multiplies


def _groups(a: np.ndarray) -> np.ndarray:
    """[N, ...] -> [G, 16, ...], the last group padded with zero rows."""
    n = a.shape[0]
    g = -(-n // 16)
    if g * 16 != n:
        a = np.concatenate([a, np.zeros((g * 16 - n, *a.shape[1:]), a.dtype)])
    return a.reshape(g, 16, *a.shape[1:])


def _interleave(a: np.ndarray, nsb: int) -> np.ndarray:
    """One value per row and position, [N, nsb * P] -> [G, nsb, P, 16]."""
    g = _groups(a)
    return g.reshape(g.shape[0], 16, nsb, -1).transpose(0, 2, 3, 1)


def _bytes(a: np.ndarray) -> np.ndarray:
    """[G, nsb, ...] -> [G, nsb, bytes]"""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(a.shape[0], a.shape[1], -1)


def _quads(a: np.ndarray) -> np.ndarray:
    """[G, nsb, SB, 16 rows] -> [G, nsb, SB / 4 quads, 16 rows, 4 k]: the i8 layout's order."""
    G, nsb, sb, _ = a.shape
    return a.reshape(G, nsb, sb // 4, 4, 16).transpose(0, 1, 2, 4, 3)


def _planes(q: np.ndarray, nsb: int, layout: str) -> np.ndarray:
    lo = _interleave((q & 15).astype(np.uint8), nsb)  # [G, nsb, SB, 16]
    if layout == "i8":  # quads 2c and 2c + 1 as the low and high nibbles of one vector
        quads = _quads(lo)
        return _bytes(quads[:, :, 0::2] | (quads[:, :, 1::2] << 4))
    return _bytes(lo[:, :, 0::2] | (lo[:, :, 1::2] << 4))


def _top_bits(q: np.ndarray, nsb: int, width: int, layout: str) -> np.ndarray:
    """The bits above the low four, `width` of them per row: one word per k, or (i8) one
    64-bit mask per quad and bit, bit 4r + j for row r's k = 4s + j."""
    hi = _interleave(((q >> 4) & ((1 << width) - 1)).astype(np.uint64), nsb)
    if layout == "i8":
        quads = _quads(hi).reshape(*hi.shape[:2], -1, 64)  # [G, nsb, quads, 64 bytes]
        place = np.arange(64, dtype=np.uint64)
        masks = [((quads >> np.uint64(bit)) & np.uint64(1)) << place for bit in range(width)]
        words = np.stack([m.sum(axis=-1, dtype=np.uint64) for m in masks], axis=-1)
        return _bytes(words)
    word = (hi << (np.arange(16, dtype=np.uint64) * width)).sum(axis=-1, dtype=np.uint64)
    return _bytes(word.astype(np.uint16 if width == 1 else np.uint32))


def _per_row(v: np.ndarray, nsb: int) -> np.ndarray:
    """A value per row and super-block, [N, nsb] -> [G, nsb, 16 values as bytes]."""
    return _bytes(_groups(v).transpose(0, 2, 1))


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.uint16)[..., 0]


def _k4_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> sc, min [..., 8] (gguf's unpacking)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def pack(raw: np.ndarray, qtype: Q, cols: int, layout: str = "fp32") -> np.ndarray:
    """raw: [N, row bytes] uint8, a GGUF tensor's rows -> [G, group bytes] uint8.

    layout "fp32" is csrc/linear.c's; "i8" (quantized types only) csrc/linear_i8.c's: the
    same headers and bytes, the quants of each 32 k in quads of 4 k (see linear_i8.c)."""
    if layout not in ("fp32", "i8") or (layout == "i8" and qtype not in I8_TYPES):
        raise ValueError(f"no {layout} layout for GGUF type {qtype.name}")
    if qtype not in SUPPORTED:
        raise ValueError(f"no CPU kernel for GGUF type {qtype.name}")
    N, K = raw.shape[0], cols
    if qtype in FLOAT_BYTES:
        it = FLOAT_BYTES[qtype]
        g = _groups(raw.reshape(N, K, it)).transpose(0, 2, 1, 3)  # [G, K, 16, bytes]
        return np.ascontiguousarray(g).reshape(g.shape[0], -1)
    nsb = K // SB[qtype]
    b = raw.reshape(N, nsb, BLOCK_BYTES[qtype])
    if qtype == Q.Q8_0:
        q = b[..., 2:34].view(np.int8).reshape(N, K)
        q = _interleave(q, nsb)
        parts = [_per_row(_f16(b[..., 0:2]), nsb), _bytes(_quads(q) if layout == "i8" else q)]
    elif qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0):
        start = {Q.Q4_0: 2, Q.Q4_1: 4, Q.Q5_0: 6}[qtype]
        qs = b[..., start:start + 16]  # byte j: weight j (low nibble), j + 16 (high)
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.uint32)  # [N, nsb, 32]
        parts = [_per_row(_f16(b[..., 0:2]), nsb)]
        if qtype == Q.Q4_1:
            parts.append(_per_row(_f16(b[..., 2:4]), nsb))
        if qtype == Q.Q5_0:
            qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)  # [N, nsb, 1]
            q |= ((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4
            parts.append(_top_bits(q.reshape(N, K), nsb, 1, layout))
        parts.append(_planes(q.reshape(N, K), nsb, layout))
    elif qtype in (Q.Q4_K, Q.Q5_K):
        sc, mn = _k4_scales(b[..., 4:16])  # [N, nsb, 8]
        qs = b[..., -128:].reshape(N, nsb, 4, 32)  # sub-blocks 2c (low) and 2c + 1 (high)
        q = np.stack([qs & 15, qs >> 4], axis=3).reshape(N, nsb, 256).astype(np.uint32)
        if qtype == Q.Q5_K:
            qh = b[..., 16:48]  # bit j of byte i: sub-block j's weight i
            bits = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
            q |= bits.reshape(N, nsb, 256).astype(np.uint32) << 4
        q = q.reshape(N, K)
        parts = [_per_row(_f16(b[..., 0:2]), nsb), _per_row(_f16(b[..., 2:4]), nsb),
                 _bytes(_interleave(sc.reshape(N, -1), nsb)),
                 _bytes(_interleave(mn.reshape(N, -1), nsb)), _planes(q, nsb, layout)]
        if qtype == Q.Q5_K:
            parts.append(_top_bits(q, nsb, 1, layout))
    else:  # Q6_K
        ql, qh, scales, d = b[..., 0:128], b[..., 128:192], b[..., 192:208], b[..., 208:210]
        lo = (ql.reshape(N, nsb, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 15
        hi = (qh.reshape(N, nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        q = (lo.reshape(N, K).astype(np.uint32) | (hi.reshape(N, K).astype(np.uint32) << 4))
        parts = [_per_row(_f16(d), nsb), _bytes(_interleave(scales.reshape(N, -1), nsb)),
                 _planes(q, nsb, layout), _top_bits(q, nsb, 2, layout)]
    out = np.concatenate(parts, axis=-1)  # [G, nsb, super-block bytes]
    return np.ascontiguousarray(out.reshape(out.shape[0], -1))
