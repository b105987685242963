"""Host-to-device staging: the arrays a step builds on the host travel in one copy.

On CUDA, `torch.tensor(list, device="cuda")` is a copy from pageable memory that blocks the
host until the GPU has run everything queued before it; a step used to make about twenty.
Packed into one pinned buffer, a step's arrays go in one non-blocking copy, and the host only
waits (before overwriting that buffer) until the previous copy has read it. On the CPU the
arrays are used where they lie.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 16  # bytes: every dtype's alignment, so each array is a valid view of the buffer


class StagingBuffer:
    def __init__(self, device: torch.device | str, capacity: int = 1 << 16,
                 copy: bool | None = None):
        """copy: pack and copy (default: on CUDA only; the tests pack on the CPU too)."""
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.copy = self.on_cuda if copy is None else copy
        self.num_copies = 0  # host-to-device copies made
        self._host = self._dev = None
        self._read = None  # CUDA event: the last copy has read the host buffer
        if self.copy:
            self._allocate(capacity)

    def _allocate(self, nbytes: int) -> None:
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.on_cuda)
        self._dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def send(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """The arrays as tensors on the device, in one copy. They stay valid until the
        next send (its copy is queued on the same stream, after this step's kernels)."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if not self.copy:
            return [torch.from_numpy(a) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // ALIGN) * ALIGN
        if self._read is not None:
            self._read.synchronize()
        if total > self._host.numel():
            self._allocate(max(total, 2 * self._host.numel()))
        host = self._host.numpy()
        for a, off in zip(arrays, offsets, strict=True):
            host[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        self._dev[:total].copy_(self._host[:total], non_blocking=self.on_cuda)
        if self.on_cuda:
            self._read = torch.cuda.Event()
            self._read.record()
        self.num_copies += 1
        return [self._dev[off:off + a.nbytes].view(torch.from_numpy(a[:0]).dtype).view(a.shape)
                for a, off in zip(arrays, offsets, strict=True)]
