"""Gemma 3 (text): Llama's skeleton with Gemma's changes.

- the token embedding is scaled by sqrt(hidden_size), and the LM head is tied to it;
- four RMSNorms per layer (before and after attention, before and after the MLP), plus an
  RMSNorm over each query and key head (QK-norm). Gemma's norm multiplies by (1 + weight);
  llama.cpp's converter already stored 1 + weight in the GGUF (transformers subtracts 1 when
  it loads the file and adds it back in the norm), so the stored weight is used as is;
- GeGLU MLP (tanh-approximated GELU on the gate);
- every `sliding_window_pattern`-th layer (1-based: layers 6, 12, 18 of 18) is global, with
  RoPE base `rope_theta`; the others attend to the last `sliding_window` positions only, with
  RoPE base `rope_local_theta`;
- attention scores are scaled by query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5;
- optional final logit soft-capping (Gemma 2 has it; Gemma 3's files do not ask for it).

Unlike llama, llama.cpp does not permute Gemma's Q/K rows (its Gemma graph uses NeoX RoPE on
the checkpoint's order), so they are used as stored.

KV cache: local layers keep every position too, in the same paged pool as the global layers.
The window is applied when attending, not by evicting blocks: with one KV head of 256 values a
token costs 18 layers x 2 x 256 floats, so the saving is small, and one block table for all
layers keeps the prefix cache uniform.
"""

from __future__ import annotations

import numpy as np

from kiln.runtime.models import tensors
from kiln.runtime.models.config import ModelConfig
from kiln.runtime.models.decoder import DecoderLayer, DecoderModel
from kiln.runtime.store.gguf_file import GGUFFile, ModelLoadError

# Not in Gemma 3's GGUF metadata: llama.cpp and transformers hard-code them for the arch.
SLIDING_WINDOW_PATTERN = 6
ROPE_LOCAL_THETA = 10000.0


def read_config(gf: GGUFFile) -> ModelConfig:
    hidden = int(gf.arch_field("embedding_length"))
    num_heads = int(gf.arch_field("attention.head_count"))
    num_layers = int(gf.arch_field("block_count"))
    head_dim = int(gf.arch_field("attention.key_length", hidden // num_heads))
    scaling = gf.arch_field("rope.scaling.type")
    factor = float(gf.arch_field("rope.scaling.factor", 1.0))
    if scaling not in (None, "none") and factor != 1.0:
        raise ModelLoadError(gf.path, f"RoPE scaling '{scaling}' x{factor} is not supported "
                                      "for gemma3 yet")
    # llama.cpp: 1/sqrt(head_dim), except the 27B model (62 layers): 1/sqrt(hidden / heads).
    query_pre_attn_scalar = hidden // num_heads if num_layers == 62 else head_dim
    return tensors.read_config(
        gf,
        rope_theta=float(gf.arch_field("rope.freq_base", 1_000_000.0)),
        rms_norm_eps=float(gf.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_dim=head_dim,
        activation="gelu_tanh",
        # HF casts sqrt(hidden) to the weights' dtype (55.4256 -> 55.5 in bf16); fp32 here.
        embedding_scale=float(np.float32(hidden ** 0.5)),
        rope_local_theta=ROPE_LOCAL_THETA,
        sliding_window=int(gf.arch_field("attention.sliding_window", 0)),
        sliding_window_pattern=SLIDING_WINDOW_PATTERN,
        final_logit_softcap=float(gf.arch_field("final_logit_softcapping", 0.0) or 0.0),
        query_pre_attn_scalar=float(query_pre_attn_scalar),
    )


def build(cfg: ModelConfig, gf: GGUFFile, backend) -> DecoderModel:
    rope_global = backend.rope_table(cfg.rotary_dim, cfg.max_position, cfg.rope_theta)
    rope_local = backend.rope_table(cfg.rotary_dim, cfg.max_position, cfg.rope_local_theta)
    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."

        def vec(name: str, p: str = p):
            return backend.vector(gf.vector(p + name))

        layers.append(DecoderLayer(
            attn_norm=vec("attn_norm.weight"),
            qkv=tensors.attention_qkv(gf, backend, p, cfg),
            o=backend.linear([gf.weight(p + "attn_output.weight")]),
            ffn_norm=vec("ffn_norm.weight"),
            gate_up=backend.linear([gf.weight(p + "ffn_gate.weight"),
                                    gf.weight(p + "ffn_up.weight")]),
            down=backend.linear([gf.weight(p + "ffn_down.weight")]),
            rope=rope_local if cfg.layer_is_local(i) else rope_global,
            sliding_window=cfg.layer_sliding_window(i),
            q_norm=vec("attn_q_norm.weight"),
            k_norm=vec("attn_k_norm.weight"),
            post_attn_norm=vec("post_attention_norm.weight"),
            post_ffn_norm=vec("post_ffw_norm.weight"),
        ))
    return tensors.finish(cfg, gf, backend, layers)
