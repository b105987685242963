"""Matrix products that read the GGUF's own quantized blocks (runtime/csrc/quant_matmul.c).

kiln's fp32 weights are the GGUF's blocks dequantized, so a product can read the blocks
instead and dequantize them in registers: the same weight values (bit for bit, as the gguf
package computes them), with fp32 activations and fp32 sums, from 4.5 (Q4_0), 5 (Q4_1) or
8.5 (Q8_0) bits a weight instead of 32. Only the order of the additions differs from a BLAS
product. A decode step is bound by reading the weights, so this is where a lone stream's
time goes. On the development Xeon (two threads, one session, weights cold as in a real
step): all the default model's products at one row took 8-9 ms against 22-26 ms in fp32
(prefetching the next rows took it from 15 ms to that), and 33-35 ms at 16 rows against
52-75 ms. The engine's decode step (bench/decode_step.py, context 300, same session): 16.1
against 30.1 ms at batch 1, 76 against 102 ms at 16. At 32 rows and more BLAS is as fast
or faster (each block is dequantized once per four rows), so `QuantLinear` hands bigger
products (batches of 32+, prefill chunks) to the fp32 weights.

The C file is compiled on first use with the machine's C compiler for its own CPU (AVX2 or
AVX-512) into kiln's home (~/.cache/kiln/ext); without a compiler or AVX2, kiln logs why
and keeps the fp32 products.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("kiln")

SOURCE = Path(__file__).with_name("csrc") / "quant_matmul.c"
# GGUF type -> (bytes a 32-weight block, the C function)
BLOCKS = {"Q4_0": (18, "q4_0_matmul"), "Q4_1": (20, "q4_1_matmul"), "Q8_0": (34, "q8_0_matmul")}
QK = 32
# Up to this many rows the block kernel beats BLAS on the default model (bench/README.md).
MAX_ROWS = 16
NUM_THREADS = os.cpu_count() or 1

_lib: ctypes.CDLL | None = None
_lib_error: str | None = None


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        return ""


def _compile(out: Path) -> None:
    cc = os.environ.get("CC", "cc")
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(tmp),
           str(SOURCE)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[-400:]}")
    tmp.replace(out)  # atomic: a second process compiling at once finds one whole file


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built once per source, compiler and CPU; None where they cannot
    be built here (the reason is logged once and kept in `library_error`)."""
    global _lib, _lib_error
    if _lib is not None or _lib_error is not None:
        return _lib
    from runtime.pull import kiln_home

    try:
        cc = os.environ.get("CC", "cc")
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256(SOURCE.read_bytes() + version.encode()
                             + _cpu_identity().encode()).hexdigest()[:16]
        out = kiln_home() / "ext" / f"quant_matmul-{key}.so"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            _compile(out)
        lib = ctypes.CDLL(str(out))
    except (OSError, RuntimeError) as exc:
        _lib_error = str(exc)
        log.warning("[kiln]  GGUF-block products unavailable, using fp32 weights: %s", exc)
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for _, fn in BLOCKS.values():
        getattr(lib, fn).argtypes = [p, i64, i64, p, i64, p, ctypes.c_int]
        getattr(lib, fn).restype = None
    _lib = lib
    return lib


def library_error() -> str | None:
    library()
    return _lib_error


@dataclass
class BlockWeight:
    """A linear layer's [out, in] weight as GGUF blocks: [out, in / 32 * block bytes]."""

    blocks: np.ndarray  # uint8, C-contiguous
    kind: str  # a key of BLOCKS
    shape: tuple[int, int]  # (out, in)

    def __post_init__(self) -> None:  # the C function, looked up once, not every product
        self._fn = getattr(library(), BLOCKS[self.kind][1])

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x: [T, in] fp32 -> x @ weight.T: [T, out] fp32."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        n, k = self.shape
        y = np.empty((x.shape[0], n), dtype=np.float32)
        self._fn(x.ctypes.data, x.shape[0], k, self.blocks.ctypes.data, n, y.ctypes.data,
                 NUM_THREADS)
        return y


def block_weight(gguf_tensors: list, permute=None) -> BlockWeight | None:
    """The GGUF tensors (gguf.ReaderTensor, [out, in] each, stacked along out) as one
    BlockWeight, or None if their types differ or have no kernel. `permute` reorders the
    rows of a tensor as its fp32 copy was reordered (llama's Q and K)."""
    kinds = {t.tensor_type.name for t in gguf_tensors}
    if len(kinds) != 1 or (kind := kinds.pop()) not in BLOCKS:
        return None
    parts = []
    for i, t in enumerate(gguf_tensors):
        raw = torch.from_numpy(np.array(t.data))  # [out, in / 32 * block bytes]
        if permute is not None and permute[i] is not None:
            raw = permute[i](raw)
        parts.append(raw.numpy())
    blocks = np.ascontiguousarray(np.concatenate(parts))
    k = blocks.shape[1] // BLOCKS[kind][0] * QK
    return BlockWeight(blocks, kind, (blocks.shape[0], k))


class QuantLinear:
    """A product's weight twice: the GGUF's blocks for a few rows, fp32 ([in, out] view) for
    many, or for --deterministic (OpenBLAS's row-invariant gemm, runtime/cpu_attention.py)."""

    __slots__ = ("blocks", "weight_t")

    def __init__(self, blocks: BlockWeight, weight_t: np.ndarray):
        self.blocks, self.weight_t = blocks, weight_t

    def uses_blocks(self, rows: int, deterministic: bool) -> bool:
        return rows <= MAX_ROWS and not deterministic
