"""The layer library shared by every architecture: norms, RoPE, MLPs, linear, attention.

On CPU, matrix products go through numpy's OpenBLAS or, for batches, torch's MKL where that
measured faster on this machine (runtime/cpu_blas.py); `--deterministic` uses OpenBLAS.
`--dtype bfloat16` hands them packed bf16 weights for oneDNN instead (runtime/packed_linear.py).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kernels.attention import paged_attention, paged_attention_ref
from kernels.kv_cache import store_kvcache, store_kvcache_ref
from runtime import cpu_blas
from runtime.attention_metadata import AttentionMetadata
from runtime.cpu_attention import (
    CpuAttentionPlan,
    min_rows_for,
    padded_matmul,
    paged_attention_cpu,
)
from runtime.packed_linear import PackedBf16
from runtime.quant_linear import QuantLinear


def linear(x: torch.Tensor, weight: torch.Tensor | PackedBf16,
           deterministic: bool = False) -> torch.Tensor:
    """x: [T, in], weight: [out, in] -> [T, out].

    deterministic: pad the rows so OpenBLAS computes each row the same way whatever the
    batch (see runtime/cpu_attention.py), so a token's bits do not depend on its neighbours.
    """
    if isinstance(weight, PackedBf16):
        return weight(x)
    if x.device.type == "cpu" and x.dtype == torch.float32:
        w = weight.numpy().T
        if deterministic:
            return torch.from_numpy(padded_matmul(x.numpy(), w, min_rows_for(w.shape[1])))
        return torch.from_numpy(cpu_blas.matmul(x.numpy(), w))
    return F.linear(x, weight)


def matmul_np(x: np.ndarray, weight_t: np.ndarray | PackedBf16,
              deterministic: bool = False) -> np.ndarray:
    """x: [T, in] @ weight_t: [in, out] (a transposed view of an [out, in] weight)."""
    if isinstance(weight_t, PackedBf16):
        return weight_t.matmul_np(x)
    if isinstance(weight_t, QuantLinear):
        if weight_t.uses_blocks(x.shape[0], deterministic):
            return weight_t.blocks.matmul(x)
        weight_t = weight_t.weight_t
    if deterministic:  # OpenBLAS's row-invariant gemm (runtime/cpu_blas.py never moves it)
        return padded_matmul(x, weight_t, min_rows_for(weight_t.shape[1]))
    return cpu_blas.matmul(x, weight_t)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def rms_norm_np(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    """rms_norm on numpy rows; each row is reduced on its own, whatever the batch."""
    return x * (np.float32(1) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * weight


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate).mul_(up)


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh").mul_(up)


class RotaryEmbedding:
    """NeoX-style rotation (rotate_half) over the full head; weights are stored in HF order."""

    def __init__(self, head_dim: int, max_position: int, base: float, device, dtype):
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        # cos/sin: [max_position, head_dim / 2]
        self.cos = freqs.cos().to(device=device, dtype=dtype)
        self.sin = freqs.sin().to(device=device, dtype=dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, 1, D/2], looked up once per forward."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, num_heads, head_dim] -> rotated copy (fp32 if x is narrower)."""
        cos, sin = cos_sin
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def paged_attention_layer(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, kv_heads, D]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int,
    use_triton: bool,
    deterministic: bool = False,
) -> torch.Tensor:
    """Store this step's K/V through the slot mapping, then attend over the paged cache."""
    key_cache, value_cache = kv_cache
    args = (q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale)
    if use_triton:
        store_kvcache(k, v, key_cache, value_cache, meta.slot_mapping)
        return paged_attention(*args, sliding_window=sliding_window)
    if q.dtype != torch.float32:
        store_kvcache_ref(k, v, key_cache, value_cache, meta.slot_mapping)
        return paged_attention_ref(*args, sliding_window=sliding_window)
    if meta.cpu_plan is None:
        meta.cpu_plan = CpuAttentionPlan.build(meta.block_tables, meta.seq_lens,
                                               meta.query_start_loc, key_cache.shape[1],
                                               deterministic, meta.slot_mapping)
    meta.cpu_plan.store(k, v, key_cache, value_cache)
    return paged_attention_cpu(*args, sliding_window=sliding_window,
                               deterministic=deterministic, plan=meta.cpu_plan)
