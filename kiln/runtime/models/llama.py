"""The llama family and the families that share its skeleton (pre-norm blocks, GQA attention,
RoPE, a SwiGLU MLP), told apart by what their GGUFs hold rather than by name:

- llama: SmolLM2, Llama 2 and 3.x (3.x's rope scaling comes as `rope_freqs.weight`), and
  Mistral, which llama.cpp converts to the llama architecture. llama.cpp's converter permutes
  llama's Q/K rows for its RoPE; they are put back in Hugging Face's order at load.
- qwen2 (Qwen2, Qwen2.5): biases on Q, K and V.
- qwen3: an RMSNorm over each query and key head (QK-norm) before RoPE, and a head size of its
  own (`attention.key_length`, not hidden / heads).
- phi3 (Phi-3 mini): Q, K and V fused in one `attn_qkv` tensor, gate and up in one `ffn_up`;
  a sliding window over every layer where the file gives one. LongRoPE files are refused.

Only llama's rows are permuted: llama.cpp runs the other three with NeoX RoPE on the
checkpoint's own order.
"""

from __future__ import annotations

from kiln.runtime.models import tensors
from kiln.runtime.models.config import ModelConfig
from kiln.runtime.models.decoder import DecoderLayer, DecoderModel
from kiln.runtime.store.gguf_file import GGUFFile, ModelLoadError

ARCHS = ("llama", "qwen2", "qwen3", "phi3")
# llama.cpp's defaults where a file leaves the key out
_DEFAULT_EPS = {"llama": 1e-5, "qwen2": 1e-6, "qwen3": 1e-6, "phi3": 1e-5}


def read_config(gf: GGUFFile) -> ModelConfig:
    if gf.has("rope_factors_long.weight"):
        raise ModelLoadError(gf.path, "LongRoPE (rope_factors_long) is not supported yet")
    eps = float(gf.arch_field("attention.layer_norm_rms_epsilon", _DEFAULT_EPS[gf.arch]))
    window = int(gf.arch_field("attention.sliding_window", 0) or 0) if gf.arch == "phi3" else 0
    return tensors.read_config(gf, rms_norm_eps=eps, sliding_window=window)


def build(cfg: ModelConfig, gf: GGUFFile, backend) -> DecoderModel:
    rope = backend.rope_table(cfg.rotary_dim, cfg.max_position, cfg.rope_theta,
                              tensors.rope_inv_freq_scale(gf, cfg))
    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        layers.append(DecoderLayer(
            attn_norm=backend.vector(gf.vector(p + "attn_norm.weight")),
            qkv=tensors.attention_qkv(gf, backend, p, cfg, unpermute_qk=cfg.arch == "llama"),
            o=backend.linear([gf.weight(p + "attn_output.weight")]),
            ffn_norm=backend.vector(gf.vector(p + "ffn_norm.weight")),
            gate_up=tensors.mlp_gate_up(gf, backend, p, cfg),
            down=backend.linear([gf.weight(p + "ffn_down.weight")]),
            rope=rope,
            sliding_window=cfg.sliding_window,
            q_norm=tensors.vector_or_none(gf, backend, p + "attn_q_norm.weight"),
            k_norm=tensors.vector_or_none(gf, backend, p + "attn_k_norm.weight"),
        ))
    return tensors.finish(cfg, gf, backend, layers)
