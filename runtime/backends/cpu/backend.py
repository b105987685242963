"""The CPU backend: kiln's C kernels (csrc/) on weights kept in the GGUF's quantization.

Bit-exact by construction: every kernel computes an output row alone, in one fixed order of
operations that depends neither on the other rows of the step (a request's neighbours in the
batch, or the rest of its prefill chunk) nor on the thread count nor on the instruction set
(csrc/simd.h). So a seeded or greedy request gives the same tokens and logprobs alone or
batched, cold or from the prefix cache, on any x86 CPU with AVX2 or AVX-512.

Threads: each kernel shares its rows or columns out over an OpenMP team of one thread per
core; torch (the sampler's few ops) keeps one thread, so only one team ever spins.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from runtime.attention_metadata import AttentionMetadata
from runtime.backends import RopeTable
from runtime.backends.cpu import library
from runtime.backends.cpu.packing import pack
from runtime.gguf_loader import WeightSource

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class PackedLinear:
    """A linear layer's weight in the packed GGUF blocks: `w(x)` is x @ W.T (+ bias).

    Several GGUF tensors stacked along the outputs (Q, K and V; gate and up) may differ in
    type; each keeps its own and writes its own columns of the one output."""

    __slots__ = ("parts", "cols", "rows", "bias", "lib", "threads")

    def __init__(self, sources: list[WeightSource], bias: torch.Tensor | None, lib, threads: int):
        self.cols = sources[0].cols
        if any(s.cols != self.cols for s in sources):
            raise ValueError("stacked weights must share their input size")
        # (GGUF type id, first output column, rows, packed blocks)
        self.parts, at = [], 0
        for s in sources:
            self.parts.append((int(s.qtype), at, s.rows, pack(s.raw_bytes(), s.qtype, s.cols)))
            at += s.rows
        self.rows, self.bias, self.lib, self.threads = at, bias, lib, threads

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, cols] fp32, rows contiguous -> [T, rows] fp32."""
        assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
        T = x.shape[0]
        y = torch.empty((T, self.rows), dtype=torch.float32)
        bias = self.bias
        for qtype, at, n, blocks in self.parts:
            self.lib.kiln_linear(_ptr(x), T, self.cols, x.stride(0), blocks.ctypes.data, qtype,
                                 n, None if bias is None else _ptr(bias) + 4 * at,
                                 _ptr(y) + 4 * at, self.rows, self.threads)
        return y


class PackedEmbedding:
    """A token embedding in packed blocks: rows looked up by id, and (tied) the LM head."""

    def __init__(self, source: WeightSource, lib, threads: int):
        self.source = source
        self.linear = PackedLinear([source], None, lib, threads)
        self.qtype, _, self.vocab, self.blocks = self.linear.parts[0]
        self.dim, self.lib, self.threads = source.cols, lib, threads

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] int64 -> [T, dim] fp32"""
        ids = ids.contiguous()
        out = torch.empty((ids.shape[0], self.dim), dtype=torch.float32)
        self.lib.kiln_embed(self.qtype, self.blocks.ctypes.data, self.dim, _ptr(ids),
                            ids.shape[0], _ptr(out), self.threads)
        return out


class CpuBackend:
    device = torch.device("cpu")
    name = "cpu"
    dtype = torch.float32

    def __init__(self, bf16_products: bool = False, threads: int | None = None,
                 extra_flags: tuple[str, ...] = ()):
        """bf16_products: the linear layers in oneDNN's packed bf16 (`--dtype bfloat16`, a
        throughput mode that is not bit-exact); everything else stays on the kernels."""
        self.lib = library.load(extra_flags)
        self.threads = threads or os.cpu_count() or 1
        self.bf16_products = bf16_products
        # The kernels bring their own team; torch's ops stay on the caller's thread, except
        # oneDNN's bf16 products, which need torch's (the same OpenMP pool as the kernels').
        torch.set_num_threads(self.threads if bf16_products else 1)

    # -- weights ---------------------------------------------------------------------------

    def linear(self, sources: list[WeightSource], bias: np.ndarray | None = None):
        b = None if bias is None else torch.from_numpy(np.ascontiguousarray(bias, np.float32))
        if self.bf16_products:
            from runtime.backends.cpu.bf16 import PackedBf16

            return PackedBf16(sources, b)
        return PackedLinear(sources, b, self.lib, self.threads)

    def embedding(self, source: WeightSource) -> PackedEmbedding:
        return PackedEmbedding(source, self.lib, self.threads)

    def lm_head(self, embedding: PackedEmbedding | None, source: WeightSource | None):
        """The output projection: its own weight, or the embedding's (tied)."""
        if source is not None:
            return self.linear([source])
        if self.bf16_products:
            from runtime.backends.cpu.bf16 import PackedBf16

            return PackedBf16([embedding.source], None)
        return embedding.linear

    def vector(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the file is read-only

    def rope_table(self, rot_dim: int, max_position: int, base: float, inv_freq_scale=None):
        return RopeTable(rot_dim, max_position, base, "cpu", inv_freq_scale)

    def kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
        """(key, value) of one layer: K transposed per block, [num_blocks, kv_heads, head_dim,
        block_size], and V as [num_blocks, kv_heads, block_size, head_dim] (csrc/attention.c)."""
        assert block_size == 16, "the kernels read a block of 16 keys as one vector"
        return (torch.zeros((num_blocks, num_kv_heads, head_dim, block_size)),
                torch.zeros((num_blocks, num_kv_heads, block_size, head_dim)))

    # -- layer operations ------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, n] (rows contiguous) -> a new [T, n]"""
        assert x.stride(-1) == 1 and x.dim() == 2
        out = torch.empty(x.shape, dtype=torch.float32)
        self.lib.kiln_rms_norm(_ptr(x), x.stride(0), 0, x.shape[0], 1, x.shape[1], _ptr(weight),
                               eps, _ptr(out), out.stride(0), 0, self.threads)
        return out

    def rms_norm_heads_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """x: [T, H, D] (a view: heads and values contiguous), normalised per head in place."""
        assert x.stride(-1) == 1 and x.stride(1) == x.shape[2]
        T, H, D = x.shape
        self.lib.kiln_rms_norm(_ptr(x), x.stride(0), D, T, H, D, _ptr(weight), eps, _ptr(x),
                               x.stride(0), D, self.threads)

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, rope: RopeTable) -> None:
        """x: [T, H, D] view (heads contiguous), rotated in place (NeoX: rotate_half)."""
        assert x.stride(-1) == 1 and x.stride(1) == x.shape[2]
        T, H, D = x.shape
        self.lib.kiln_rope(_ptr(x), x.stride(0), D, T, H, rope.rot_dim, _ptr(positions),
                           _ptr(rope.cos), _ptr(rope.sin), self.threads)

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """gate_up: [T, 2F] (gate, then up) -> act(gate) * up: [T, F]"""
        T, F2 = gate_up.shape
        out = torch.empty((T, F2 // 2), dtype=torch.float32)
        self.lib.kiln_act_mul(_ptr(gate_up), gate_up.stride(0), T, F2 // 2,
                              ACTIVATIONS[activation], _ptr(out), out.stride(0), self.threads)
        return out

    def attention(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim] view, heads contiguous
        k: torch.Tensor,  # [T, num_kv_heads, head_dim] view
        v: torch.Tensor,  # [T, num_kv_heads, head_dim] view
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        """Store this step's K/V through the slot mapping, then attend over the paged cache."""
        key_cache, value_cache = kv_cache
        assert meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32
        assert meta.slot_mapping.dtype == torch.int64 and meta.block_tables.stride(1) == 1
        T, H, D = q.shape
        KVH = k.shape[1]
        for t in (q, k, v):
            assert t.stride(-1) == 1 and t.stride(1) == D
        self.lib.kiln_store_kv(_ptr(k), k.stride(0), _ptr(v), v.stride(0),
                               _ptr(meta.slot_mapping), T, KVH, D, _ptr(key_cache),
                               _ptr(value_cache))
        out = torch.empty((T, H * D), dtype=torch.float32)
        bt = meta.block_tables
        self.lib.kiln_attention(_ptr(q), q.stride(0), D, _ptr(key_cache), _ptr(value_cache),
                                _ptr(bt), bt.stride(0), _ptr(meta.seq_lens),
                                _ptr(meta.query_start_loc), meta.num_seqs, H, KVH, D, scale,
                                sliding_window, _ptr(out), H * D, D, self.threads)
        return out
