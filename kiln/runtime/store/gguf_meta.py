"""A GGUF file's metadata without loading it: its key-values and tensor sizes, for the routes
that describe a model (Ollama's /api/show and /api/tags).

gguf.GGUFReader builds a numpy view of every string of the vocabulary (15 s for Gemma 3's
262,144 tokens); describing a model needs none of them. This reads the header once, keeping
scalars and short arrays, and only counts the elements of long ones (the vocabulary, scores,
merges), and sums the tensors' element counts for the parameter count. Results are cached
per (path, size, mtime), so a replaced file is read again.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kiln.runtime.store.gguf_file import ModelLoadError

# GGUFValueType -> struct format of one element (STRING = 8 and ARRAY = 9 are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_ARRAY_KEPT = 5  # longer arrays are counted, not read (Ollama's /api/show shows them empty)

# gguf.LlamaFileType values -> the quantization names llama.cpp and Ollama print
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
              10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S",
              15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS",
              20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
              25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS",
              31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0"}


@dataclass(frozen=True)
class LongArray:
    """An array of more than MAX_ARRAY_KEPT elements, left unread."""

    length: int


@dataclass(frozen=True)
class GGUFMetadata:
    fields: dict  # key -> int | float | bool | str | list | LongArray
    parameter_count: int  # the sum of every tensor's element count

    def get(self, key: str, default=None):
        value = self.fields.get(key, default)
        return default if isinstance(value, LongArray) else value

    @property
    def arch(self) -> str:
        return self.get("general.architecture", "")

    @property
    def quantization(self) -> str:
        file_type = self.get("general.file_type")
        return FILE_TYPES.get(file_type, "unknown") if file_type is not None else "unknown"


class _Cursor:
    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.buf[self.pos:self.pos + n]
        if len(raw) != n:
            raise struct.error("string past the end of the file")
        self.pos += n
        return bytes(raw).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.unpack("<Q")  # (not `pos += unpack()`: that reads pos before unpack moves it)
        self.pos += n

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.unpack("<I"), self.unpack("<Q")
            if n > MAX_ARRAY_KEPT:
                self.skip_array(etype, n)
                return LongArray(n)
            return [self.value(etype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise struct.error(f"unknown GGUF value type {vtype}")
        return self.unpack(_SCALARS[vtype])

    def skip_array(self, etype: int, n: int) -> None:
        if etype in _SCALARS:
            self.pos += n * struct.calcsize(_SCALARS[etype])
        elif etype == _STRING:
            for _ in range(n):
                self.skip_string()
        else:
            for _ in range(n):
                self.value(etype)


def read_metadata(path: str | os.PathLike) -> GGUFMetadata:
    """The metadata of the GGUF at `path` (cached while the file is unchanged)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as exc:
        raise ModelLoadError(path, "no such file") from exc
    return _read(str(path), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=16)
def _read(path: str, size: int, mtime_ns: int) -> GGUFMetadata:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ModelLoadError(path, "not a GGUF file (bad magic number)")
        cur = _Cursor(buf)
        cur.pos = 4
        try:
            version = cur.unpack("<I")
            if version < 2:
                raise ModelLoadError(path, f"GGUF version {version} is not supported")
            num_tensors, num_fields = cur.unpack("<Q"), cur.unpack("<Q")
            fields = {}
            for _ in range(num_fields):
                key = cur.string()
                fields[key] = cur.value(cur.unpack("<I"))
            params = 0
            for _ in range(num_tensors):
                cur.skip_string()
                count = 1
                for _ in range(cur.unpack("<I")):
                    count *= cur.unpack("<Q")
                cur.pos += 4 + 8  # type, offset
                params += count
        except (struct.error, IndexError) as exc:
            raise ModelLoadError(path, f"truncated or corrupt GGUF header ({exc})") from exc
    return GGUFMetadata(fields, params)
