"""kiln's GGUF header reader (runtime/store/gguf_meta.py) against the gguf package's own
GGUFReader, on a small file written with GGUFWriter holding every value type, short and long
arrays, a vocabulary of strings and quantized tensors."""

import gguf
import numpy as np
import pytest

from kiln.runtime.store.gguf_file import ModelLoadError
from kiln.runtime.store.gguf_meta import MAX_ARRAY_KEPT, LongArray, read_metadata

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "meta.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_chat_template(TEMPLATE)
    w.add_bool("tiny.flag", True)
    w.add_int8("tiny.i8", -3)
    w.add_uint16("tiny.u16", 65000)
    w.add_int64("tiny.i64", -(2**40))
    w.add_uint64("tiny.u64", 2**50)
    w.add_float32("tiny.f32", 0.1)
    w.add_float64("tiny.f64", 0.1)
    w.add_array("tiny.short", [1, 2, 3])
    w.add_array("tiny.short_strings", ["a", "é", "z"])
    w.add_token_list([f"tok{i}" * (i % 7) for i in range(1000)])  # strings of every length
    w.add_token_scores([float(i) for i in range(1000)])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((32, 64), dtype=np.float32))
    q = gguf.quants.quantize(rng.standard_normal((8, 64), dtype=np.float32),
                             gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("b.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_fields_and_parameter_count_match_the_gguf_package(path):
    reader = gguf.GGUFReader(path)
    meta = read_metadata(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(meta.fields) == set(expected)
    for key, value in expected.items():
        if isinstance(value, list) and len(value) > MAX_ARRAY_KEPT:
            assert meta.fields[key] == LongArray(len(value)), key
        else:
            assert meta.fields[key] == value, key
    assert meta.parameter_count == sum(int(t.n_elements) for t in reader.tensors) \
        == 32 * 64 + 8 * 64
    assert meta.arch == "llama" and meta.quantization == "Q8_0"
    assert meta.get("tokenizer.chat_template") == TEMPLATE
    assert meta.get("tokenizer.ggml.tokens") is None  # a long array is counted, not read


def test_a_truncated_or_foreign_file_is_a_load_error(path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="truncated"):
        read_metadata(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        read_metadata(other)
