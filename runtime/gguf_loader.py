"""Read a GGUF file: its metadata into a ModelConfig, its tensors into fp32 torch tensors.

Dequantized weights are cached as safetensors beside the model cache, keyed by the file's
identity, so the second load of the same file skips dequantization.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SUPPORTED_ARCHS = ("llama", "gemma3")
_GGUF_MAGIC = b"GGUF"


class ModelLoadError(RuntimeError):
    """A GGUF that kiln cannot load; the message names the file and the reason."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"cannot load {path}: {reason}")
        self.path, self.reason = str(path), reason


@dataclass
class GGUFFile:
    path: Path
    reader: object  # gguf.GGUFReader
    arch: str

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        return value

    def arch_field(self, key: str, default=None):
        return self.field(f"{self.arch}.{key}", default)


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


def _cache_path(path: Path) -> Path:
    from runtime.pull import kiln_home

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v1".encode())
    return kiln_home() / "weights" / f"{path.stem}-{key.hexdigest()[:16]}.safetensors"


def load_tensors(gf: GGUFFile, use_cache: bool = True) -> dict[str, torch.Tensor]:
    """All tensors dequantized to fp32, shaped as torch expects ([out, in] for matrices)."""
    from safetensors.torch import load_file, save_file

    cache = _cache_path(gf.path)
    if use_cache and cache.is_file():
        return load_file(cache)
    import gguf

    tensors = {}
    for t in gf.reader.tensors:
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelLoadError(gf.path, f"tensor {t.name} ({t.tensor_type.name}): {exc}") \
                from exc
        tensors[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32))
    if use_cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        save_file(tensors, tmp)
        tmp.replace(cache)
    return tensors
