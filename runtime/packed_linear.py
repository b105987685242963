"""bf16 weights packed once for oneDNN, for the CPU's matrix products (`--dtype bfloat16`).

On a CPU with AMX or AVX-512-BF16, oneDNN multiplies bf16 by bf16 with fp32 accumulation in
hardware, and reads half the bytes of an fp32 weight. One decode step of the default model's
products (bench figures on the development Xeon, one session): 15-16 ms in bf16 against
21-24 ms in fp32 at one row, 16 against 52 ms at 16 rows, 21-24 against 94 ms at 64 rows.
Packing into oneDNN's blocked layout at load time is what makes it pay: the same bf16
weights through `F.linear` took 22.5 ms at one row.

Only the products change: their inputs and outputs are rounded to bf16 (oneDNN's op has no
fp32 output) and come back as fp32, so the residual stream, norms, attention and the KV cache
stay fp32. Without native
bf16 the products would be slower than fp32 (shared/perf-notes.md), so kiln refuses the
setting there rather than quietly running slower.
"""

from __future__ import annotations

import numpy as np
import torch


def bf16_supported() -> bool:
    """Whether this CPU multiplies bf16 natively (oneDNN's own test: AVX-512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bf16_refusal(cuda: bool, deterministic: bool) -> str | None:
    """Why `--dtype bfloat16` cannot run here, or None if it can."""
    if cuda:
        return "--dtype bfloat16 runs on the CPU only so far"
    if deterministic:
        return "--deterministic needs --dtype float32 (oneDNN's products are not batch-invariant)"
    if not bf16_supported():
        return ("--dtype bfloat16 needs a CPU with native bf16 (AVX-512-BF16 or AMX); "
                "without it the products are slower than in float32")
    return None


class PackedBf16:
    """A linear layer's [out, in] weight in bf16, in oneDNN's layout for this CPU."""

    __slots__ = ("packed",)

    def __init__(self, weight: torch.Tensor):  # [out, in], any float dtype, on the CPU
        self.packed = torch.ops.mkldnn._reorder_linear_weight(
            weight.to(torch.bfloat16).contiguous(), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] fp32 -> x @ weight.T: [T, out] fp32."""
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16).contiguous(), self.packed,
                                               None, "none", [], "")
        return y.float()

    def matmul_np(self, x: np.ndarray) -> np.ndarray:
        """The same on numpy rows: x: [T, in] fp32 -> [T, out] fp32."""
        return self(torch.from_numpy(x)).numpy()


def packs_weights(device, dtype: torch.dtype, use_triton: bool) -> bool:
    """Whether a model loaded so runs the CPU's bf16 path: fp32 activations, packed weights."""
    return torch.device(device).type == "cpu" and not use_triton and dtype == torch.bfloat16


def product_weight(weight: torch.Tensor, device, dtype: torch.dtype,
                   packed: bool) -> torch.Tensor | PackedBf16:
    """A linear layer's [out, in] weight as the forward multiplies by it."""
    if packed:
        return PackedBf16(weight)
    return weight.to(device=device, dtype=dtype).contiguous()
