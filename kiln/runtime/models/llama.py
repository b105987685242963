"""Llama (SmolLM2 and friends): RMSNorm, RoPE, GQA attention over the paged cache, SwiGLU."""

from __future__ import annotations

import numpy as np

from kiln.runtime.config import ModelConfig
from kiln.runtime.gguf_loader import GGUFFile
from kiln.runtime.models.decoder import DecoderLayer, DecoderModel


def read_config(gf: GGUFFile) -> ModelConfig:
    num_heads = int(gf.arch_field("attention.head_count"))
    hidden = int(gf.arch_field("embedding_length"))
    vocab = gf.arch_field("vocab_size") or len(gf.field("tokenizer.ggml.tokens"))
    return ModelConfig(
        arch="llama",
        num_layers=int(gf.arch_field("block_count")),
        hidden_size=hidden,
        intermediate_size=int(gf.arch_field("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(gf.arch_field("attention.head_count_kv", num_heads)),
        head_dim=int(gf.arch_field("rope.dimension_count", hidden // num_heads)),
        vocab_size=int(vocab),
        max_position=int(gf.arch_field("context_length")),
        rope_theta=float(gf.arch_field("rope.freq_base", 10000.0)),
        rms_norm_eps=float(gf.arch_field("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings=not gf.has("output.weight"),
    )


def rope_unpermutation(rows: int, num_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's Q/K rows for its RoPE: the row order that
    undoes it (Hugging Face's order, rotated with rotate_half)."""
    return np.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(0, 2, 1) \
        .reshape(-1)


def build(cfg: ModelConfig, gf: GGUFFile, backend) -> DecoderModel:
    rope = backend.rope_table(cfg.head_dim, cfg.max_position, cfg.rope_theta)
    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        q, k = gf.weight(p + "attn_q.weight"), gf.weight(p + "attn_k.weight")
        q = q.permute_rows(rope_unpermutation(q.rows, cfg.num_heads))
        k = k.permute_rows(rope_unpermutation(k.rows, cfg.num_kv_heads))
        layers.append(DecoderLayer(
            attn_norm=backend.vector(gf.vector(p + "attn_norm.weight")),
            qkv=backend.linear([q, k, gf.weight(p + "attn_v.weight")]),
            o=backend.linear([gf.weight(p + "attn_output.weight")]),
            ffn_norm=backend.vector(gf.vector(p + "ffn_norm.weight")),
            gate_up=backend.linear([gf.weight(p + "ffn_gate.weight"),
                                    gf.weight(p + "ffn_up.weight")]),
            down=backend.linear([gf.weight(p + "ffn_down.weight")]),
            rope=rope,
        ))
    embed = backend.embedding(gf.weight("token_embd.weight"))
    head = None if cfg.tie_word_embeddings else gf.weight("output.weight")
    return DecoderModel(cfg, backend, embed, layers,
                        backend.vector(gf.vector("output_norm.weight")),
                        backend.lm_head(embed, head))
