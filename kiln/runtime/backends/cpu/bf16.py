"""bf16 weights packed once for oneDNN, for the CPU's linear layers (`--dtype bfloat16`).

On a CPU with AMX or AVX-512-BF16, oneDNN multiplies bf16 by bf16 with fp32 accumulation in
hardware, from half the bytes of an fp32 weight. Only the products change: their inputs and
outputs are rounded to bf16, so logits stay within bf16 rounding of fp32 but are not bit-exact,
and a row's bits may follow its batch (oneDNN picks kernels by shape). Norms, attention, the KV
cache and the sampler stay on kiln's fp32 kernels. Without native bf16 the products would be
slower than fp32 (shared/perf-notes.md), so kiln refuses the setting there.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.runtime.store.gguf_file import WeightSource


def bf16_supported() -> bool:
    """Whether this CPU multiplies bf16 natively (oneDNN's own test: AVX-512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedBf16:
    """A linear layer's weights (stacked along the outputs) in bf16, in oneDNN's layout."""

    __slots__ = ("packed", "bias")

    def __init__(self, sources: list[WeightSource], bias: torch.Tensor | None):
        weight = torch.from_numpy(np.concatenate([s.dequantize() for s in sources]))
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16), None)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] fp32 -> x @ weight.T (+ bias): [T, out] fp32."""
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16).contiguous(), self.packed,
                                               None, "none", [], "").float()
        return y if self.bias is None else y.add_(self.bias)
