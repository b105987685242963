"""The operator's model directories: the `.gguf` files a client may name (`--models-dir`).

A client's string is only ever compared with the names a directory listing returns; it is
never joined onto a path, so `../`, absolute paths and odd bytes name nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kiln.runtime.store.catalogue import CATALOGUE
from kiln.runtime.store.pull import kiln_home

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"


def default_models_dir() -> Path:
    """Where `kiln pull` puts files."""
    return kiln_home() / "models"


def _is_gguf(path: Path) -> bool:
    """A regular file (a symlink the operator placed is followed) that starts as a GGUF."""
    try:
        if not path.is_file():  # before opening: a FIFO would block the open
            return False
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class LocalModel:
    """A GGUF in a models directory: `name` (its file name) is what clients call it."""

    name: str
    path: Path

    @property
    def stem(self) -> str:
        return self.name[:-len(GGUF_SUFFIX)]


@dataclass(frozen=True)
class ModelDirs:
    dirs: tuple[Path, ...]

    def listing(self) -> list[LocalModel]:
        """Every GGUF file (`.gguf`, the GGUF magic) of the directories, first directory
        first; a file name seen twice keeps its first. The catalogue's own files are left
        out (clients name those by their tags). A directory that does not exist (yet) holds
        nothing."""
        catalogue_files = {e.filename for e in CATALOGUE.values()}
        seen: dict[str, LocalModel] = {}
        for d in self.dirs:
            try:
                entries = sorted(os.scandir(d), key=lambda e: e.name)
            except OSError:
                continue
            for e in entries:
                if not e.name.endswith(GGUF_SUFFIX) or e.name.startswith(".") \
                        or e.name in seen or e.name in catalogue_files:
                    continue
                path = Path(d) / e.name
                if _is_gguf(path):
                    seen[e.name] = LocalModel(e.name, path)
        return list(seen.values())

    def find(self, name: str) -> LocalModel | None:
        """The file a client names by its file name or its stem."""
        listing = self.listing()
        return next((m for m in listing if m.name == name), None) \
            or next((m for m in listing if m.stem == name), None)
