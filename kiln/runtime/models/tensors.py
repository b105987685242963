"""A decoder's hyper-parameters and weights as llama.cpp names them in a GGUF
(`{arch}.attention.head_count`, `blk.{i}.attn_q.weight`, ...), shared by the families."""

from __future__ import annotations

import numpy as np

from kiln.runtime.models.config import ModelConfig
from kiln.runtime.models.decoder import DecoderModel
from kiln.runtime.store.gguf_file import GGUFFile, ModelLoadError


def read_config(gf: GGUFFile, **overrides) -> ModelConfig:
    """The keys every family stores; `overrides` are the family's own (activation, norms...).
    head_dim is the file's key_length where it has one (Qwen3, Gemma 3: not hidden / heads)."""
    num_heads = int(gf.arch_field("attention.head_count"))
    hidden = int(gf.arch_field("embedding_length"))
    vocab = gf.arch_field("vocab_size") or len(gf.field("tokenizer.ggml.tokens"))
    fields = dict(
        arch=gf.arch,
        num_layers=int(gf.arch_field("block_count")),
        hidden_size=hidden,
        intermediate_size=int(gf.arch_field("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(gf.arch_field("attention.head_count_kv", num_heads)),
        head_dim=int(gf.arch_field("attention.key_length", hidden // num_heads)),
        vocab_size=int(vocab),
        max_position=int(gf.arch_field("context_length")),
        rope_theta=float(gf.arch_field("rope.freq_base", 10000.0)),
        rms_norm_eps=float(gf.arch_field("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings=not gf.has("output.weight"),
    )
    fields["rope_dim"] = int(gf.arch_field("rope.dimension_count", fields["head_dim"]))
    return ModelConfig(**(fields | overrides))


def rope_inv_freq_scale(gf: GGUFFile, cfg: ModelConfig) -> np.ndarray | None:
    """What RoPE's inverse frequencies are divided by, or None for plain RoPE.

    Llama 3.x: llama.cpp's converter stores its per-frequency factors as `rope_freqs.weight`
    (the file then asks for no scaling type). Linear scaling divides them all by its factor.
    Other kinds (YaRN, LongRoPE) are refused: ignoring them would give wrong logits quietly."""
    if gf.has("rope_freqs.weight"):
        factors = gf.vector("rope_freqs.weight")
        if factors.shape[0] != cfg.rope_dim // 2:
            raise ModelLoadError(gf.path, f"rope_freqs.weight has {factors.shape[0]} values, "
                                          f"not rope_dim / 2 = {cfg.rope_dim // 2}")
        return factors
    kind = gf.arch_field("rope.scaling.type")
    factor = float(gf.arch_field("rope.scaling.factor", 1.0) or 1.0)
    if kind in (None, "none") or factor == 1.0:
        return None
    if kind == "linear":
        return np.full(cfg.rope_dim // 2, factor, dtype=np.float32)
    raise ModelLoadError(gf.path, f"RoPE scaling '{kind}' x{factor} is not supported for "
                                  f"{cfg.arch} yet")


def qk_unpermutation(rows: int, num_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's Q/K rows for its llama RoPE (pairs of
    adjacent values): the row order that undoes it, back to Hugging Face's (rotate_half)."""
    return np.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(0, 2, 1) \
        .reshape(-1)


def attention_qkv(gf: GGUFFile, backend, prefix: str, cfg: ModelConfig,
                  unpermute_qk: bool = False):
    """Q, K and V as one product: `attn_qkv` where the file has it fused (Phi-3), else the
    three stacked, with their biases where the file has them (Qwen2)."""
    if gf.has(prefix + "attn_qkv.weight"):
        bias = prefix + "attn_qkv.bias"
        return backend.linear([gf.weight(prefix + "attn_qkv.weight")],
                              gf.vector(bias) if gf.has(bias) else None)
    q, k = gf.weight(prefix + "attn_q.weight"), gf.weight(prefix + "attn_k.weight")
    if unpermute_qk:
        q = q.permute_rows(qk_unpermutation(q.rows, cfg.num_heads))
        k = k.permute_rows(qk_unpermutation(k.rows, cfg.num_kv_heads))
    names = [prefix + f"attn_{x}.bias" for x in "qkv"]
    bias = None
    if any(gf.has(n) for n in names):
        bias = np.concatenate([gf.vector(n) for n in names])
    return backend.linear([q, k, gf.weight(prefix + "attn_v.weight")], bias)


def mlp_gate_up(gf: GGUFFile, backend, prefix: str, cfg: ModelConfig):
    """Gate and up as one product: stacked, or `ffn_up` alone where it holds both (Phi-3)."""
    up = gf.weight(prefix + "ffn_up.weight")
    if not gf.has(prefix + "ffn_gate.weight"):
        if up.rows != 2 * cfg.intermediate_size:
            raise ModelLoadError(gf.path, f"{prefix}ffn_up.weight has {up.rows} rows: no "
                                          "ffn_gate, and not gate and up fused")
        return backend.linear([up])
    return backend.linear([gf.weight(prefix + "ffn_gate.weight"), up])


def vector_or_none(gf: GGUFFile, backend, name: str):
    return backend.vector(gf.vector(name)) if gf.has(name) else None


def finish(cfg: ModelConfig, gf: GGUFFile, backend, layers) -> DecoderModel:
    """The embedding, the final norm and the LM head (its own weight, or tied)."""
    embed = backend.embedding(gf.weight("token_embd.weight"))
    head = None if cfg.tie_word_embeddings else gf.weight("output.weight")
    return DecoderModel(cfg, backend, embed, layers,
                        backend.vector(gf.vector("output_norm.weight")),
                        backend.lm_head(embed, head))
