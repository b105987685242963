"""Where a model's arithmetic runs. A backend is chosen once, at load, and owns everything
that depends on the device: the form of the weights (`linear` returns an object the forward
calls as `w(x)`), the KV cache's layout, and the layer operations (norms, RoPE, gated
activations, paged attention). The model files never ask which one they run on.

- `CpuBackend` (backends/cpu): kiln's own C kernels on the GGUF's blocks, fp32, the same
  bits for a request whatever it is batched with (the default on a CPU);
- `DenseBackend` (backends/dense.py): torch on dequantized weights, with the Triton kernels
  for attention on CUDA (or in the interpreter, for the tests), their torch references
  otherwise.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger("kiln")


class RopeTable:
    """cos and sin of RoPE's angles for every position: [max_position, rot_dim / 2] fp32.
    `inv_freq_scale` (Llama 3's per-frequency factors) divides the inverse frequencies."""

    def __init__(self, rot_dim: int, max_position: int, base: float, device,
                 inv_freq_scale: np.ndarray | None = None):
        inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
        if inv_freq_scale is not None:
            inv_freq = inv_freq / torch.tensor(np.array(inv_freq_scale, dtype=np.float64))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        self.rot_dim = rot_dim
        self.cos = freqs.cos().to(device=device, dtype=torch.float32).contiguous()
        self.sin = freqs.sin().to(device=device, dtype=torch.float32).contiguous()


DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(name: str, cuda: bool) -> str:
    """`auto`: bf16 on a GPU that has it (fp16 otherwise), fp32 on the CPU."""
    if name != "auto":
        return name
    if cuda:
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def dtype_refusal(name: str, cuda: bool) -> str | None:
    """Why `--dtype name` cannot run here, or None if it can."""
    name = resolve_dtype(name, cuda)
    if cuda:
        if name == "bfloat16" and not torch.cuda.is_bf16_supported():
            return "--dtype bfloat16 needs a GPU with bf16 (sm_80 or later); try float16"
        return None
    if name == "float16":
        return "--dtype float16 runs on CUDA only; on the CPU use float32 or bfloat16"
    if name == "bfloat16":
        from kiln.runtime.backends.cpu.bf16 import bf16_supported

        if not bf16_supported():
            return ("--dtype bfloat16 needs a CPU with native bf16 (AVX-512-BF16 or AMX); "
                    "without it the products are slower than in float32")
    return None


def make_backend(device: str = "cpu", dtype: torch.dtype = torch.float32,
                 use_triton: bool = False, threads: int | None = None,
                 int8_activations: bool = False, kv_fp16: bool = False,
                 batch_invariant: bool = False):
    """The CPU kernels where they run (fp32 or --dtype bfloat16 products on the CPU, or
    products on 8-bit activations; an fp32 or fp16 KV cache); otherwise torch on dense
    weights (with batch_invariant, Triton's fixed-order products instead of cuBLAS's).
    threads: the CPU kernels' (default: one per core)."""
    if torch.device(device).type == "cpu" and not use_triton:
        from kiln.runtime.backends.cpu import library

        reason = library.unavailable_reason()
        if reason is None:
            from kiln.runtime.backends.cpu.backend import CpuBackend

            return CpuBackend(bf16_products=dtype == torch.bfloat16, threads=threads,
                              int8_products=int8_activations, kv_fp16=kv_fp16,
                              reuse_outputs=True)
        log.warning("[kiln]  CPU kernels unavailable, using torch (slower, and a request's "
                    "bits may follow its batch): %s", reason)
    from kiln.runtime.backends.dense import DenseBackend

    return DenseBackend(device, dtype, use_triton, batch_invariant)
