"""Tiny random-weight GGUF files, written with the gguf package, for tests that need a whole
model without the cost of a real one. The tokenizer (and chat template) is borrowed from a
real GGUF, so the file loads like any other."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

TOKENIZER_KEYS = ("tokenizer.", "general.quantization_version")


def copy_tokenizer(writer: gguf.GGUFWriter, reader: gguf.GGUFReader,
                   without: tuple[str, ...] = ()) -> int:
    """Every tokenizer.* field of `reader` (but those named in `without`) into `writer`;
    returns the vocabulary size."""
    for key, field in reader.fields.items():
        if not key.startswith(TOKENIZER_KEYS) or key in without:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    return len(reader.fields["tokenizer.ggml.tokens"].contents())


def write_gguf(path: Path, arch: str, metadata: dict, tensors: dict[str, np.ndarray],
               tokenizer_from: str | Path | gguf.GGUFReader | None,
               qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
               name: str | None = None, without: tuple[str, ...] = ()) -> Path:
    """metadata: `{arch}.*` keys without the prefix -> value (ints as uint32, floats as
    float32); tensors in torch's orientation ([out, in]), float32, written as F32 unless
    `qtypes` names a GGUF type for them (quantized by the gguf package). `name`:
    general.name (transformers reads a llama file named "mistral..." as Mistral). `without`:
    tokenizer fields not to copy (tokenizer.chat_template: a model with no template). With no
    tokenizer_from the file has none (a forward alone needs only `vocab_size`, in metadata)."""
    writer = gguf.GGUFWriter(str(path), arch)
    if name:
        writer.add_name(name)
    for key, value in metadata.items():
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_string(full, value)
    if tokenizer_from is not None:
        reader = tokenizer_from if isinstance(tokenizer_from, gguf.GGUFReader) \
            else gguf.GGUFReader(str(tokenizer_from))  # (reading a vocabulary takes seconds)
        copy_tokenizer(writer, reader, without)
    for name, array in tensors.items():
        qtype = (qtypes or {}).get(name, gguf.GGMLQuantizationType.F32)
        array = np.ascontiguousarray(array, dtype=np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_shape=array.shape,
                              raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_tensors(vocab: int, hidden: int = 128, inter: int = 256, layers: int = 2,
                  heads: int = 2, kv_heads: int = 1, head_dim: int = 64,
                  seed: int = 0) -> dict[str, np.ndarray]:
    """A llama's tensors with GGUF names. The attention weights are large enough that a K/V
    row in the wrong slot changes the logits."""
    rng = np.random.default_rng(seed)

    def rand(*shape, scale=0.1):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)

    q, kv = heads * head_dim, kv_heads * head_dim
    t = {"token_embd.weight": rand(vocab, hidden, scale=0.3),
         "output_norm.weight": 1 + rand(hidden)}
    for i in range(layers):
        p = f"blk.{i}."
        t |= {p + "attn_norm.weight": 1 + rand(hidden), p + "ffn_norm.weight": 1 + rand(hidden),
              p + "attn_q.weight": rand(q, hidden, scale=0.3),
              p + "attn_k.weight": rand(kv, hidden, scale=0.3),
              p + "attn_v.weight": rand(kv, hidden, scale=0.5),
              p + "attn_output.weight": rand(hidden, q),
              p + "ffn_gate.weight": rand(inter, hidden), p + "ffn_up.weight": rand(inter, hidden),
              p + "ffn_down.weight": rand(hidden, inter)}
    return t


def llama_metadata(hidden: int = 128, inter: int = 256, layers: int = 2, heads: int = 2,
                   kv_heads: int = 1, head_dim: int = 64, ctx: int = 4096) -> dict:
    return {"block_count": layers, "context_length": ctx, "embedding_length": hidden,
            "feed_forward_length": inter, "attention.head_count": heads,
            "attention.head_count_kv": kv_heads, "rope.dimension_count": head_dim,
            "rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5}
