"""Output buffers a call site reuses from one step to the next.

A decode step at one stream is as much Python as it is products: about 240 kernel calls, each
of which used to allocate its output (`torch.empty`, 1.5-3 us: ~0.5 ms of a 6.5 ms step for
smollm2:135m on our 2-core host). A site's output of up to DECODE_ROWS rows is a view of one
buffer instead, cut once per row count. It stays valid until the site runs again: every
caller reads it first (a layer's products, norms, activation and attention are each read
within the layer, the last norm by the LM head of the same step).

Larger steps (prefill chunks, many streams) take a view of a `LargeOutput` that several sites
share: allocated fresh, a prefill chunk's outputs were pages the kernel mapped and zeroed for
every call (glibc maps each allocation over 32 MB on its own and unmaps it when freed: 380k
page faults for a 2,000-token prompt of qwen2.5-coder:0.5b, whose prefill ran 1.19x faster
without them). A shared output stays valid until another of its sites runs; decoder.py reads
each product's, norm's, activation's and attention's output before the next of its kind runs.
"""

from __future__ import annotations

import torch

DECODE_ROWS = 16


class LargeOutput:
    """Outputs of more than DECODE_ROWS rows of one width: one buffer, grown to the largest
    step seen (a prefill chunk's), that the sites sharing it take in turn."""

    __slots__ = ("cols", "buffer")

    def __init__(self, cols: int):
        self.cols = cols
        self.buffer = torch.empty((0, cols), dtype=torch.float32)

    def __call__(self, rows: int) -> torch.Tensor:
        if self.buffer.shape[0] < rows:
            self.buffer = torch.empty((rows, self.cols), dtype=torch.float32)
        return self.buffer[:rows]


class Outputs:
    __slots__ = ("cols", "views", "large")

    def __init__(self, large: LargeOutput):
        self.cols, self.large = large.cols, large
        self.views: dict[int, torch.Tensor] = {}

    def __call__(self, rows: int) -> torch.Tensor:
        """An uninitialised [rows, cols] fp32 tensor, rows contiguous."""
        out = self.views.get(rows)
        if out is not None:
            return out
        if rows > DECODE_ROWS:
            return self.large(rows)
        if not self.views:
            buffer = torch.empty((DECODE_ROWS, self.cols), dtype=torch.float32)
            self.views.update((n, buffer[:n]) for n in range(1, DECODE_ROWS + 1))
        return self.views[rows]
