"""Output buffers a call site reuses from one decode step to the next.

A decode step at one stream is as much Python as it is products: about 240 kernel calls, each
of which used to allocate its output (`torch.empty`, 1.5-3 us: ~0.5 ms of a 6.5 ms step for
smollm2:135m on our 2-core host). A site's output of up to DECODE_ROWS rows is a view of one
buffer instead, cut once per row count. It stays valid until the site runs again: every
caller reads it first (a layer's products, norms, activation and attention are each read
within the layer, the last norm by the LM head of the same step). Larger steps (prefill)
allocate, where an allocation is nothing next to the work.
"""

from __future__ import annotations

import torch

DECODE_ROWS = 16


class Outputs:
    __slots__ = ("cols", "views")

    def __init__(self, cols: int):
        self.cols = cols
        self.views: dict[int, torch.Tensor] = {}

    def __call__(self, rows: int) -> torch.Tensor:
        """An uninitialised [rows, cols] fp32 tensor, rows contiguous."""
        out = self.views.get(rows)
        if out is not None:
            return out
        if rows > DECODE_ROWS:
            return torch.empty((rows, self.cols), dtype=torch.float32)
        if not self.views:
            buffer = torch.empty((DECODE_ROWS, self.cols), dtype=torch.float32)
            self.views.update((n, buffer[:n]) for n in range(1, DECODE_ROWS + 1))
        return self.views[rows]
