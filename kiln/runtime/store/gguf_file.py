"""Read a GGUF file: its metadata, and its tensors as they are stored.

The file is memory-mapped (gguf.GGUFReader); a 2-D weight is handed to a backend as a
`WeightSource`, its raw blocks, which the backend keeps as they are (the CPU kernels), or
dequantizes to the dtype it computes in (the dense torch backend).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
_GGUF_MAGIC = b"GGUF"


class ModelLoadError(RuntimeError):
    """A GGUF that kiln cannot load; the message names the file and the reason."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"cannot load {path}: {reason}")
        self.path, self.reason = str(path), reason


@dataclass(frozen=True)
class WeightSource:
    """One 2-D weight as the GGUF stores it, in torch's orientation: `rows` outputs (the
    GGUF's ne1) of `cols` inputs each, row r being `raw[r]`."""

    name: str
    qtype: object  # gguf.GGMLQuantizationType
    rows: int
    cols: int
    raw: np.ndarray  # [rows, row bytes] uint8, or [rows, cols] of a float dtype

    def raw_bytes(self) -> np.ndarray:
        """[rows, row bytes] uint8, without a copy."""
        return np.ascontiguousarray(self.raw).view(np.uint8).reshape(self.rows, -1)

    def dequantize(self) -> np.ndarray:
        """[rows, cols] float32, the gguf package's values."""
        import gguf

        # a copy even of float32 data: the file's pages are mapped read-only
        return np.array(gguf.quants.dequantize(self.raw, self.qtype),
                        dtype=np.float32).reshape(self.rows, self.cols)

    def permute_rows(self, order: np.ndarray) -> WeightSource:
        return WeightSource(self.name, self.qtype, self.rows, self.cols,
                            np.ascontiguousarray(self.raw_bytes()[order]))


@dataclass
class GGUFFile:
    path: Path
    reader: object  # gguf.GGUFReader
    arch: str
    tensors: dict = field(init=False, repr=False)  # name -> gguf.ReaderTensor

    def __post_init__(self) -> None:
        self.tensors = {t.name: t for t in self.reader.tensors}

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def arch_field(self, key: str, default=None):
        return self.field(f"{self.arch}.{key}", default)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def _get(self, name: str):
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(self.path, f"missing tensor '{name}'") from None

    def weight(self, name: str) -> WeightSource:
        t = self._get(name)
        if len(t.shape) != 2:
            raise ModelLoadError(self.path, f"tensor {name} is not a matrix ({list(t.shape)})")
        cols, rows = (int(n) for n in t.shape)
        return WeightSource(name, t.tensor_type, rows, cols, t.data)

    def vector(self, name: str) -> np.ndarray:
        """A 1-D tensor (a norm's weight, a bias) in float32."""
        import gguf

        t = self._get(name)
        try:
            return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type),
                              dtype=np.float32).reshape(-1)
        except Exception as exc:
            raise ModelLoadError(self.path, f"tensor {name} ({t.tensor_type.name}): {exc}") \
                from exc


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(path, "no such file")
    with open(path, "rb") as fh:
        if fh.read(4) != _GGUF_MAGIC:
            raise ModelLoadError(path, "not a GGUF file (bad magic number)")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the gguf package raises many types for a damaged file
        raise ModelLoadError(path, f"truncated or corrupt GGUF ({type(exc).__name__}: {exc})") \
            from exc
    f = reader.fields.get("general.architecture")
    if f is None:
        raise ModelLoadError(path, "no general.architecture in the metadata")
    arch = f.contents()
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(path, f"unsupported architecture '{arch}' "
                                   f"(kiln supports {', '.join(SUPPORTED_ARCHS)})")
    return GGUFFile(path, reader, arch)
