"""The CPU backend: kiln's C kernels (csrc/) on weights kept in the GGUF's quantization.

Bit-exact by construction: every kernel computes an output row alone, in one fixed order of
operations that depends neither on the other rows of the step (a request's neighbours in the
batch, or the rest of its prefill chunk) nor on the thread count nor on the instruction set
(csrc/simd.h). So a seeded or greedy request gives the same tokens and logprobs alone or
batched, cold or from the prefix cache, on any x86 CPU with AVX2 or AVX-512.

Threads: each kernel shares its rows or columns out over kiln's own pool of one thread per
core (csrc/pool.c); torch (the sampler's few ops) keeps one thread, so only one pool ever
spins.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from kiln.runtime.backends import RopeTable
from kiln.runtime.backends.cpu import library
from kiln.runtime.backends.cpu.outputs import LargeOutput, Outputs
from kiln.runtime.backends.cpu.packing import I8_TYPES, pack
from kiln.runtime.kv.attention_metadata import AttentionMetadata
from kiln.runtime.store.gguf_file import WeightSource

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


class PackedLinear:
    """A linear layer's weight in the packed GGUF blocks: `w(x)` is x @ W.T (+ bias).

    Several GGUF tensors stacked along the outputs (Q, K and V; gate and up) may differ in
    type; each keeps its own and writes its own columns of the one output.

    int8: the products on 8-bit activations (csrc/linear_i8.c) where every part's type has
    them and K is whole blocks of 32; the fp32 products (csrc/linear.c) otherwise.
    out: where the outputs go (outputs.py): a decode step's into the layer's own buffer, valid
    until the layer runs again, a larger step's into the one its width shares with the
    backend's other products; None (a new tensor each call) for the LM head, whose logits
    the engine keeps for the step."""

    __slots__ = ("blocks", "parts", "cols", "rows", "bias", "lib", "threads", "int8", "_args",
                 "_out")

    def __init__(self, sources: list[WeightSource], bias: torch.Tensor | None, lib, threads: int,
                 int8: bool = False, out: Outputs | None = None):
        self.cols = sources[0].cols
        if any(s.cols != self.cols for s in sources):
            raise ValueError("stacked weights must share their input size")
        self.int8 = int8 and self.cols % 32 == 0 and all(s.qtype in I8_TYPES for s in sources)
        layout = "i8" if self.int8 else "fp32"
        self.blocks = [pack(s.raw_bytes(), s.qtype, s.cols, layout) for s in sources]  # kept alive
        self.parts = (library.Part * len(sources))()
        at = 0
        for part, s, blocks in zip(self.parts, sources, self.blocks, strict=True):
            part.type, part.rows, part.col0, part.blocks = int(s.qtype), s.rows, at, \
                blocks.ctypes.data
            at += s.rows
        self.rows, self.bias, self.lib, self.threads = at, bias, lib, threads
        # the call's constant arguments, worked out once: this is the decode step's hot path
        self._args = (ctypes.addressof(self.parts), len(sources),
                      None if bias is None else bias.data_ptr())
        if out is not None and out.cols != at:
            raise ValueError(f"outputs of width {out.cols} for a product of {at}")
        self._out = out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, cols] fp32, rows contiguous -> [T, rows] fp32."""
        assert x.stride(1) == 1 and x.dtype == torch.float32
        T = x.shape[0]
        y = self._out(T) if self._out is not None else \
            torch.empty((T, self.rows), dtype=torch.float32)
        parts, nparts, bias = self._args
        if not self.int8:
            self.lib.kiln_linear(x.data_ptr(), T, self.cols, x.stride(0), parts, nparts, bias,
                                 y.data_ptr(), self.rows, self.threads)
        elif self.lib.kiln_linear_i8(x.data_ptr(), T, self.cols, x.stride(0), parts, nparts,
                                     bias, y.data_ptr(), self.rows, self.threads):
            raise MemoryError(f"no scratch for {T} x {self.cols} 8-bit activations")
        return y


class PackedEmbedding:
    """A token embedding in packed blocks: rows looked up by id, and (tied) the LM head."""

    def __init__(self, source: WeightSource, lib, threads: int):
        self.source = source
        self.linear = PackedLinear([source], None, lib, threads)
        self.qtype, self.blocks = int(source.qtype), self.linear.blocks[0]
        self.dim, self.lib, self.threads = source.cols, lib, threads

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] int64 -> [T, dim] fp32"""
        ids = ids.contiguous()
        out = torch.empty((ids.shape[0], self.dim), dtype=torch.float32)
        self.lib.kiln_embed(self.qtype, self.blocks.ctypes.data, self.dim, ids.data_ptr(),
                            ids.shape[0], out.data_ptr(), self.threads)
        return out


class CpuBackend:
    device = torch.device("cpu")
    name = "cpu"
    dtype = torch.float32

    def __init__(self, bf16_products: bool = False, threads: int | None = None,
                 extra_flags: tuple[str, ...] = (), int8_products: bool = False,
                 kv_fp16: bool = False, reuse_outputs: bool = False):
        """bf16_products: the linear layers in oneDNN's packed bf16 (`--dtype bfloat16`, a
        throughput mode that is not bit-exact); everything else stays on the kernels.
        int8_products: the quantized linear layers on 8-bit activations (csrc/linear_i8.c);
        kv_fp16: K and V stored in fp16. Both keep a row's bits independent of its batch;
        `--dtype auto` sets both, `--dtype float32` neither (logits within 1e-4 of
        transformers').
        reuse_outputs: each layer operation's output of a decode step is a buffer of its own,
        valid until it runs again, a larger step's one that the operation's kind and width
        share (outputs.py), as the model's forward reads them; off, every call returns a new
        tensor."""
        self.lib = library.load(extra_flags)
        self.threads = threads or os.cpu_count() or 1
        self.bf16_products, self.int8_products = bf16_products, int8_products
        self.kv_fp16 = kv_fp16
        self.name = "cpu" + (", 8-bit activations" if int8_products else "") + \
            (", fp16 KV cache" if kv_fp16 else "")
        products = "8-bit activations" if int8_products else \
            "bf16 (oneDNN, not bit-exact)" if bf16_products else "fp32"
        # A reply's bits follow these, and not the batch, the threads or the ISA.
        self.numerics = f"cpu kernels: products {products}, KV cache " + \
            ("fp16" if kv_fp16 else "fp32")
        # The kernels bring their own pool; torch's ops stay on the caller's thread, except
        # oneDNN's bf16 products, which run on torch's own threads. Process-wide, so it is
        # set by the thread that steps this model (ModelRunner), not here: a model loading
        # for a switch must not retune the one still serving.
        self.torch_threads = self.threads if bf16_products else 1
        self.reuse_outputs = reuse_outputs
        self._outputs: dict[tuple[str, int], Outputs] = {}  # (op, width): norms, act, attention
        self._large: dict[tuple[str, int], LargeOutput] = {}  # (op, width), "linear" for products

    def _output(self, op: str, rows: int, cols: int) -> torch.Tensor:
        """op's output for this step (with reuse_outputs valid until op runs again)."""
        if not self.reuse_outputs:
            return torch.empty((rows, cols), dtype=torch.float32)
        out = self._outputs.get((op, cols))
        if out is None:
            out = self._outputs[op, cols] = Outputs(self._large_output(op, cols))
        return out(rows)

    def _large_output(self, op: str, cols: int) -> LargeOutput:
        large = self._large.get((op, cols))
        if large is None:
            large = self._large[op, cols] = LargeOutput(cols)
        return large

    # -- weights ---------------------------------------------------------------------------

    def linear(self, sources: list[WeightSource], bias: np.ndarray | None = None):
        b = None if bias is None else torch.from_numpy(np.ascontiguousarray(bias, np.float32))
        if self.bf16_products:
            from kiln.runtime.backends.cpu.bf16 import PackedBf16

            return PackedBf16(sources, b)
        out = None
        if self.reuse_outputs:
            out = Outputs(self._large_output("linear", sum(s.rows for s in sources)))
        return PackedLinear(sources, b, self.lib, self.threads, self.int8_products, out)

    def embedding(self, source: WeightSource) -> PackedEmbedding:
        return PackedEmbedding(source, self.lib, self.threads)

    def lm_head(self, embedding: PackedEmbedding | None, source: WeightSource | None):
        """The output projection: its own weight, or the embedding's (tied)."""
        weight = source if source is not None else embedding.source
        if self.bf16_products:
            from kiln.runtime.backends.cpu.bf16 import PackedBf16

            return PackedBf16([weight], None)
        if source is not None or self.int8_products:  # tied in i8: a copy in the i8 layout
            return PackedLinear([weight], None, self.lib, self.threads, self.int8_products)
        return embedding.linear

    def vector(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the file is read-only

    def rope_table(self, rot_dim: int, max_position: int, base: float, inv_freq_scale=None):
        return RopeTable(rot_dim, max_position, base, "cpu", inv_freq_scale)

    def kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
        """(key, value) of one layer: K transposed per block, [num_blocks, kv_heads, head_dim,
        block_size], and V as [num_blocks, kv_heads, block_size, head_dim] (csrc/attention.c)."""
        assert block_size == 16, "the kernels read a block of 16 keys as one vector"
        dtype = torch.float16 if self.kv_fp16 else torch.float32
        return (torch.zeros((num_blocks, num_kv_heads, head_dim, block_size), dtype=dtype),
                torch.zeros((num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype))

    # -- layer operations ------------------------------------------------------------------

    # The wrappers below run about 300 times a decode step: each checks what the kernel
    # relies on with one cheap assert and hands it raw pointers and strides.

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, n] (rows contiguous) -> [T, n] (a new tensor, or with reuse_outputs the
        norms' buffer for this width)"""
        T, n = x.shape
        assert x.stride(1) == 1
        out = self._output("rms_norm", T, n)
        self.lib.kiln_rms_norm(x.data_ptr(), x.stride(0), 0, T, 1, n, weight.data_ptr(), eps,
                               out.data_ptr(), n, 0, self.threads)
        return out

    def rms_norm_heads_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """x: [T, H, D] (a view: heads and values contiguous), normalised per head in place."""
        T, H, D = x.shape
        assert x.stride(1) == D and x.stride(2) == 1
        self.lib.kiln_rms_norm(x.data_ptr(), x.stride(0), D, T, H, D, weight.data_ptr(), eps,
                               x.data_ptr(), x.stride(0), D, self.threads)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float, delta_weight: torch.Tensor | None = None) -> torch.Tensor:
        """h += delta (normalised with delta_weight first, if given) in place; rms_norm(h)."""
        if delta_weight is not None:
            delta = self.rms_norm(delta, delta_weight, eps)
        h.add_(delta)
        return self.rms_norm(h, weight, eps)

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, rope: RopeTable) -> None:
        """x: [T, H, D] view (heads contiguous), rotated in place (NeoX: rotate_half).
        positions: [T] int64."""
        T, H, D = x.shape
        assert x.stride(1) == D and x.stride(2) == 1
        self.lib.kiln_rope(x.data_ptr(), x.stride(0), D, T, H, rope.rot_dim, positions.data_ptr(),
                           rope.cos.data_ptr(), rope.sin.data_ptr(), self.threads)

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """gate_up: [T, 2F] (gate, then up, rows contiguous) -> act(gate) * up: [T, F]"""
        T, F2 = gate_up.shape
        assert gate_up.stride(1) == 1
        out = self._output("act_mul", T, F2 // 2)
        self.lib.kiln_act_mul(gate_up.data_ptr(), gate_up.stride(0), T, F2 // 2,
                              ACTIVATIONS[activation], out.data_ptr(), F2 // 2, self.threads)
        return out

    def rope_store_kv(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim] view, heads contiguous
        k: torch.Tensor,  # [T, num_kv_heads, head_dim] view
        v: torch.Tensor,  # [T, num_kv_heads, head_dim] view
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        rope: RopeTable,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # (q w, k w, eps)
    ) -> None:
        """Normalise each head of q and k (QK-norm) and rotate them (RoPE) in place, then
        store this step's K/V through the slot mapping (-1: nowhere)."""
        if qk_norm is not None:
            self.rms_norm_heads_(q, qk_norm[0], qk_norm[2])
            self.rms_norm_heads_(k, qk_norm[1], qk_norm[2])
        key_cache, value_cache = kv_cache
        T, H, D = q.shape
        KVH = k.shape[1]
        if k.data_ptr() == q.data_ptr() + 4 * H * D and k.stride(0) == q.stride(0):
            # k's heads follow q's in the one product: one call rotates both (a decode step
            # makes some 300 calls; each one costs a few us of Python)
            assert q.stride(1) == D and q.stride(2) == 1
            self.lib.kiln_rope(q.data_ptr(), q.stride(0), D, T, H + KVH, rope.rot_dim,
                               positions.data_ptr(), rope.cos.data_ptr(), rope.sin.data_ptr(),
                               self.threads)
        else:
            self.rope_(q, positions, rope)
            self.rope_(k, positions, rope)
        assert q.stride(1) == k.stride(1) == v.stride(1) == D and v.stride(2) == 1
        self.lib.kiln_store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                               slot_mapping.data_ptr(), T, KVH, D, key_cache.data_ptr(),
                               value_cache.data_ptr(), self.kv_fp16)

    def attention(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim] view, heads contiguous
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int,
        out: torch.Tensor | None = None,  # [T, num_heads * head_dim], contiguous
    ) -> torch.Tensor:  # [T, num_heads * head_dim]: out if given
        """Attend over the paged cache. The metadata's dtypes (int32 tables and lengths) are
        the runner's."""
        key_cache, value_cache = kv_cache
        T, H, D = q.shape
        KVH = key_cache.shape[1]
        assert key_cache.shape[2] == D, "not this backend's layout (kv_cache)"
        if out is None:
            out = self._output("attention", T, H * D)
        assert out.shape == (T, H * D) and out.is_contiguous()
        bt = meta.block_tables
        self.lib.kiln_attention(q.data_ptr(), q.stride(0), D, key_cache.data_ptr(),
                                value_cache.data_ptr(), bt.data_ptr(), bt.stride(0),
                                meta.seq_lens.data_ptr(), meta.query_start_loc.data_ptr(),
                                bt.shape[0], H, KVH, D, scale, sliding_window, out.data_ptr(),
                                H * D, D, self.kv_fp16, self.threads)
        return out
