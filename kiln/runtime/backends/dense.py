"""The dense backend: torch on dequantized weights. On CUDA (and on CPU tensors under
TRITON_INTERPRET, for the tests) attention and the KV store are kiln's Triton kernels;
otherwise their torch references, which also serve where the CPU kernels cannot be built.

KV cache layout (kernels/__init__.py): [num_blocks, block_size, num_kv_heads, head_dim] for
keys and values alike.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kiln.kernels.attention import paged_attention, paged_attention_ref
from kiln.kernels.kv_cache import store_kvcache, store_kvcache_ref
from kiln.runtime.backends import RopeTable
from kiln.runtime.kv.attention_metadata import AttentionMetadata
from kiln.runtime.store.gguf_file import WeightSource

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


class DenseLinear:
    __slots__ = ("weight", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias  # [out, in], [out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class DenseEmbedding:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [vocab, dim]
        self.linear = DenseLinear(weight, None)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class DenseBackend:
    name = "dense"

    def __init__(self, device="cpu", dtype: torch.dtype = torch.float32,
                 use_triton: bool = False):
        self.device, self.dtype, self.use_triton = torch.device(device), dtype, use_triton
        self.torch_threads = None  # torch's own choice

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values).to(device=self.device, dtype=self.dtype).contiguous()

    def linear(self, sources: list[WeightSource], bias: np.ndarray | None = None) -> DenseLinear:
        weight = self._tensor(np.concatenate([s.dequantize() for s in sources]))
        return DenseLinear(weight, None if bias is None else self._tensor(bias))

    def embedding(self, source: WeightSource) -> DenseEmbedding:
        return DenseEmbedding(self._tensor(source.dequantize()))

    def lm_head(self, embedding: DenseEmbedding | None, source: WeightSource | None):
        return self.linear([source]) if source is not None else embedding.linear

    def vector(self, values: np.ndarray) -> torch.Tensor:
        """Norm weights and the like stay fp32: the norms run in fp32."""
        return torch.from_numpy(np.array(values, dtype=np.float32)).to(self.device)

    def rope_table(self, rot_dim: int, max_position: int, base: float, inv_freq_scale=None):
        return RopeTable(rot_dim, max_position, base, self.device, inv_freq_scale)

    def kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """In fp32, cast back (Gemma's activations outgrow fp16)."""
        return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)

    def rms_norm_heads_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        x.copy_(self.rms_norm(x, weight, eps))

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, rope: RopeTable) -> None:
        """x: [T, H, D] view, its first rot_dim values rotated in place (rotate_half)."""
        half = rope.rot_dim // 2
        cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
        x1, x2 = x[..., :half].float(), x[..., half:rope.rot_dim].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x[..., :rope.rot_dim] = rotated.to(x.dtype)

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return ACTIVATIONS[activation](gate).mul_(up)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                  scale: float, sliding_window: int) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        args = (q, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                meta.query_start_loc, scale)
        if self.use_triton:
            store_kvcache(k, v, key_cache, value_cache, meta.slot_mapping)
            out = paged_attention(*args, sliding_window=sliding_window,
                                  max_seq_len=meta.max_seq_len)
        else:
            store_kvcache_ref(k, v, key_cache, value_cache, meta.slot_mapping)
            out = paged_attention_ref(*args, sliding_window=sliding_window)
        return out.reshape(q.shape[0], -1)
