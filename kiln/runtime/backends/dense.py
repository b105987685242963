"""The dense backend: torch's products on dequantized weights. On CUDA (and on CPU tensors
under TRITON_INTERPRET, for the tests) everything between the products is kiln's Triton
kernels: RMSNorm and the residual add fused with it, QK-norm + RoPE + the KV store, the gated
activation, paged attention; otherwise their torch references, which also serve where the
CPU kernels cannot be built. With `batch_invariant` (kiln serve's default on CUDA) the
products are kernels/matmul.py's, whose tiles never follow the batch, instead of cuBLAS's.

KV cache layout (kernels/__init__.py): [num_blocks, block_size, num_kv_heads, head_dim] for
keys and values alike.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
import triton

from kiln.kernels.activation import act_mul, act_mul_ref
from kiln.kernels.attention import TILE_ROWS, paged_attention
from kiln.kernels.attention_ref import paged_attention_ref
from kiln.kernels.kv_cache import rope_store_kvcache, rope_store_kvcache_ref
from kiln.kernels.matmul import matmul
from kiln.kernels.rms_norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from kiln.runtime.backends import RopeTable
from kiln.runtime.kv.attention_metadata import AttentionMetadata
from kiln.runtime.store.gguf_file import WeightSource


class DenseLinear:
    __slots__ = ("weight", "bias", "product")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, product=F.linear):
        self.weight, self.bias = weight, bias  # [out, in], [out]
        self.product = product  # F.linear, or kernels/matmul.py's batch-invariant one

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)


class DenseEmbedding:
    def __init__(self, weight: torch.Tensor, product=F.linear):
        self.weight = weight  # [vocab, dim]
        self.linear = DenseLinear(weight, None, product)  # a tied LM head

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class DenseBackend:
    name = "dense"

    def __init__(self, device="cpu", dtype: torch.dtype = torch.float32,
                 use_triton: bool = False, batch_invariant: bool = False):
        if batch_invariant and not use_triton:
            raise ValueError("the batch-invariant products are Triton kernels: use_triton")
        self.device, self.dtype, self.use_triton = torch.device(device), dtype, use_triton
        self.batch_invariant = batch_invariant
        self.product = matmul if batch_invariant else F.linear
        self.torch_threads = None  # torch's own choice

    @property
    def numerics(self) -> str:
        """What decides a reply's bits: torch's (and cuBLAS's) version and the device; the
        Triton kernels' version and attention's tile height where they run."""
        where = str(self.device)
        if self.device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(self.device)
            where += f" ({torch.cuda.get_device_name(self.device)}, sm_{major}{minor}, " \
                f"CUDA {torch.version.cuda})"
        kernels = f", triton {triton.__version__}, attention tiles of {TILE_ROWS} rows" \
            if self.use_triton else ""
        products = ", batch-invariant products" if self.batch_invariant else ""
        return f"dense: torch {torch.__version__} {str(self.dtype)[6:]} on {where}{kernels}" \
            f"{products}"

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values).to(device=self.device, dtype=self.dtype).contiguous()

    def linear(self, sources: list[WeightSource], bias: np.ndarray | None = None) -> DenseLinear:
        weight = self._tensor(np.concatenate([s.dequantize() for s in sources]))
        return DenseLinear(weight, None if bias is None else self._tensor(bias), self.product)

    def embedding(self, source: WeightSource) -> DenseEmbedding:
        return DenseEmbedding(self._tensor(source.dequantize()), self.product)

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
        return (rms_norm if self.use_triton else rms_norm_ref)(x, weight, eps)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float, delta_weight: torch.Tensor | None = None) -> torch.Tensor:
        """h += delta (normalised with delta_weight first, if given) in place; rms_norm(h)."""
        fn = add_rms_norm if self.use_triton else add_rms_norm_ref
        return fn(h, delta, weight, eps, delta_weight)

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        return (act_mul if self.use_triton else act_mul_ref)(gate_up, activation)

    def rope_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor,
                      positions: torch.Tensor, rope: RopeTable,
                      qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
        """q, k, v: views of this step's product, q and k not yet normalised nor rotated; q is
        normalised and rotated in place, k on its way into the cache, v stored as it is."""
        fn = rope_store_kvcache if self.use_triton else rope_store_kvcache_ref
        fn(q, k, v, *kv_cache, slot_mapping, positions, rope.cos, rope.sin, qk_norm)

    def attention(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                  meta: AttentionMetadata, scale: float, sliding_window: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, heads, head_dim] over the paged cache -> [T, heads * head_dim], in out if
        given (a buffer a CUDA graph reads)."""
        args = (q, *kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
        heads = None if out is None else out.view(q.shape)
        if self.use_triton:
            heads = paged_attention(*args, sliding_window=sliding_window,
                                    max_seq_len=meta.max_seq_len,
                                    max_query_len=meta.max_query_len, out=heads)
        else:
            heads = paged_attention_ref(*args, sliding_window=sliding_window, out=heads)
        return heads.reshape(q.shape[0], -1)
