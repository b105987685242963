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


class StaticInputs:
    """Named device tensors at fixed addresses in one buffer (the CUDA graphs' inputs), filled
    from a pinned host copy of the same layout in one transfer: a step's padded inputs go
    straight where the captured kernels read them, with no device-to-device copy between."""

    def __init__(self, device: torch.device | str,
                 fields: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        """fields: (name, dtype, shape), in layout order; a send copies a prefix of it."""
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        sizes = [torch.empty(shape, dtype=dtype, device="meta").nbytes
                 for _, dtype, shape in fields]
        self.offsets, total = {}, 0
        for (name, _, _), n in zip(fields, sizes, strict=True):
            self.offsets[name] = total
            total += -(-n // ALIGN) * ALIGN
        self._dev = torch.zeros(total, dtype=torch.uint8, device=self.device)
        self._host = torch.zeros(total, dtype=torch.uint8, pin_memory=self.on_cuda)
        self.tensors, self._host_arrays = {}, {}
        for (name, dtype, shape), n in zip(fields, sizes, strict=True):
            off = self.offsets[name]
            self.tensors[name] = self._dev[off:off + n].view(dtype).view(shape)
            self._host_arrays[name] = self._host[off:off + n].view(dtype).view(shape).numpy()
        self._read = None  # CUDA event: the last send has read the host copy

    def host(self) -> dict[str, np.ndarray]:
        """The host copy's arrays, to write a step's inputs into (after the last send read
        them)."""
        if self._read is not None:
            self._read.synchronize()
        return self._host_arrays

    def send(self, last: str, last_nbytes: int) -> None:
        """Copy the layout up to `last_nbytes` into the field `last` (the rest stays)."""
        end = self.offsets[last] + last_nbytes
        self._dev[:end].copy_(self._host[:end], non_blocking=self.on_cuda)
        if self.on_cuda:
            self._read = torch.cuda.Event()
            self._read.record()


class StepInputs(StaticInputs):
    """A step's arrays where the CUDA graphs read them: the tokens' (ids, positions, slots,
    logits rows) for up to num_tokens, the sequences' (lengths, starts, block tables) for up
    to num_seqs; the block tables last, so a send stops at the step's rows of them."""

    def __init__(self, device: torch.device | str, num_tokens: int, num_seqs: int,
                 max_blocks: int):
        T, S = num_tokens, num_seqs
        super().__init__(device, [
            ("input_ids", torch.int64, (T,)), ("positions", torch.int64, (T,)),
            ("slot_mapping", torch.int64, (T,)), ("logits_indices", torch.int64, (T,)),
            ("seq_lens", torch.int32, (S,)), ("query_start_loc", torch.int32, (S + 1,)),
            ("block_tables", torch.int32, (S, max_blocks))])

    def stage(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
              query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
              logits_indices: np.ndarray) -> list[torch.Tensor]:
        """The arrays -> the tensors holding them (in this order), sent in one copy. Stale
        block-table columns past this step's width are never read: a row reads only the
        blocks its seq_len covers."""
        T, S = len(input_ids), len(seq_lens)
        host, t = self.host(), self.tensors
        host["input_ids"][:T] = input_ids
        host["positions"][:T] = positions
        host["slot_mapping"][:T] = slot_mapping
        host["logits_indices"][:len(logits_indices)] = logits_indices
        host["seq_lens"][:S] = seq_lens
        host["query_start_loc"][:S + 1] = query_start_loc
        host["block_tables"][:S, :block_tables.shape[1]] = block_tables
        self.send("block_tables", t["block_tables"][:S].nbytes)
        return [t["input_ids"][:T], t["positions"][:T], t["slot_mapping"][:T],
                t["query_start_loc"][:S + 1], t["seq_lens"][:S],
                t["block_tables"][:S, :block_tables.shape[1]],
                t["logits_indices"][:len(logits_indices)]]


# The sampler's per-row columns (Sampler.columns' first nine), and what a row that samples
# nothing takes: greedy, every filter and penalty off.
SAMPLER_FIELDS = (("temperature", torch.float32, 0.0), ("top_k", torch.int32, 0),
                  ("top_p", torch.float32, 1.0), ("min_p", torch.float32, 0.0),
                  ("repetition_penalty", torch.float32, 1.0),
                  ("frequency_penalty", torch.float32, 0.0),
                  ("presence_penalty", torch.float32, 0.0), ("seeds", torch.int64, 0),
                  ("offsets", torch.int64, 0))


class SamplerInputs(StaticInputs):
    """The sampler's columns where a CUDA graph's sampler reads them, for up to num_rows
    rows, and their penalty windows (window_width columns, -1 padded) last, so a step without
    windows sends the columns alone."""

    def __init__(self, device: torch.device | str, num_rows: int, window_width: int):
        super().__init__(device, [(name, dtype, (num_rows,))
                                  for name, dtype, _ in SAMPLER_FIELDS]
                         + [("window", torch.int64, (num_rows, window_width))])
        self.window = self.tensors["window"]
        self.window.fill_(-1)

    def stage(self, columns: list[np.ndarray], rows: int, window: np.ndarray | None) -> None:
        """The step's columns (SAMPLER_FIELDS' order) for its first rows, the rows after
        them up to `rows` sampling nothing; where given, its windows ([rows, <= width]), the
        rest of each -1. One copy."""
        host, n = self.host(), len(columns[0])
        for (name, _, idle), column in zip(SAMPLER_FIELDS, columns, strict=True):
            host[name][:n] = column
            host[name][n:rows] = idle
        if window is None:
            last = SAMPLER_FIELDS[-1][0]
            self.send(last, self.tensors[last].nbytes)
            return
        w = window.shape[1]
        host["window"][:n, :w] = window
        host["window"][:n, w:] = host["window"][n:rows] = -1
        self.send("window", self.window[:rows].nbytes)
