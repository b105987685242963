"""The sha256 of a model's GGUF, the weights' part of a reply's `system_fingerprint`.

A catalogue model's is its entry's (its file was checked against it when pulled); any other
file is read once per process (a few seconds for a large model, at load, off the event loop)
and remembered by its path, size and modification time.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from kiln.runtime.store.catalogue import CatalogueEntry

CHUNK = 1 << 22


def weights_sha256(path: Path, entry: CatalogueEntry | None) -> str:
    if entry is not None:
        return entry.sha256
    stat = Path(path).stat()
    return _file_sha256(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
