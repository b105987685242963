"""A GGUF kiln cannot load fails with a message naming the file and the reason."""

import pytest

from kiln.runtime.store.gguf_file import ModelLoadError, open_gguf
from kiln.runtime.store.pull import PullError, resolve_model


def test_non_gguf_file_is_rejected_by_name(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("this is not a model")
    with pytest.raises(ModelLoadError) as err:
        open_gguf(bad)
    assert str(err.value) == f"cannot load {bad}: not a GGUF file (bad magic number)"


def test_truncated_gguf_is_rejected_by_name(tmp_path, smollm2_gguf):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src:
        cut.write_bytes(src.read(3_000_000))
    with pytest.raises(ModelLoadError) as err:
        open_gguf(cut)
    assert str(err.value).startswith(f"cannot load {cut}: truncated or corrupt GGUF")


def test_missing_file_and_unknown_tag():
    with pytest.raises(PullError, match="no such file"):
        resolve_model("/nonexistent/model.gguf")
    with pytest.raises(PullError, match="unknown model 'nosuch:1b'"):
        resolve_model("nosuch:1b")
