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

import torch

from runtime.attention_metadata import AttentionMetadata
from runtime.config import ModelConfig
from runtime.gguf_loader import GGUFFile, ModelLoadError
from runtime.layers import (
    RotaryEmbedding,
    gelu_tanh_and_mul,
    linear,
    paged_attention_layer,
    rms_norm,
)
from runtime.packed_linear import PackedBf16, packs_weights, product_weight

# Not in Gemma 3's GGUF metadata: llama.cpp and transformers hard-code them for the arch.
SLIDING_WINDOW_PATTERN = 6
ROPE_LOCAL_THETA = 10000.0


def read_config(gf: GGUFFile) -> ModelConfig:
    num_heads = int(gf.arch_field("attention.head_count"))
    hidden = int(gf.arch_field("embedding_length"))
    num_layers = int(gf.arch_field("block_count"))
    head_dim = int(gf.arch_field("attention.key_length", hidden // num_heads))
    vocab = gf.arch_field("vocab_size") or len(gf.field("tokenizer.ggml.tokens"))
    scaling = gf.arch_field("rope.scaling.type")
    factor = float(gf.arch_field("rope.scaling.factor", 1.0))
    if scaling not in (None, "none") and factor != 1.0:
        raise ModelLoadError(gf.path, f"RoPE scaling '{scaling}' x{factor} is not supported "
                                      "for gemma3 yet")
    # llama.cpp: 1/sqrt(head_dim), except the 27B model (62 layers): 1/sqrt(hidden / heads).
    query_pre_attn_scalar = hidden // num_heads if num_layers == 62 else head_dim
    tensor_names = {t.name for t in gf.reader.tensors}
    return ModelConfig(
        arch="gemma3",
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(gf.arch_field("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(gf.arch_field("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_position=int(gf.arch_field("context_length")),
        rope_theta=float(gf.arch_field("rope.freq_base", 1_000_000.0)),
        rms_norm_eps=float(gf.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_local_theta=ROPE_LOCAL_THETA,
        sliding_window=int(gf.arch_field("attention.sliding_window", 0)),
        sliding_window_pattern=SLIDING_WINDOW_PATTERN,
        final_logit_softcap=float(gf.arch_field("final_logit_softcapping", 0.0) or 0.0),
        query_pre_attn_scalar=float(query_pre_attn_scalar),
    )


class Gemma3Model:
    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], device, dtype,
                 use_triton: bool = False):
        self.cfg, self.use_triton = cfg, use_triton
        # bf16 on the CPU: fp32 activations, the products' weights packed for oneDNN.
        self.cpu_bf16 = packs_weights(device, dtype, use_triton)
        if self.cpu_bf16:
            dtype = torch.float32

        def w(name: str) -> torch.Tensor:
            return tensors[name].to(device=device, dtype=dtype).contiguous()

        def product(weight: torch.Tensor) -> torch.Tensor | PackedBf16:  # [out, in]
            return product_weight(weight, device, dtype, self.cpu_bf16)

        def norm(name: str) -> torch.Tensor:  # kept in fp32: norms run in fp32 (see _norm)
            return tensors[name].to(device=device, dtype=torch.float32).contiguous()

        self.embed = w("token_embd.weight")  # [vocab, hidden]
        if cfg.tie_word_embeddings:  # the same tensor, or a packed bf16 copy of it
            self.lm_head = PackedBf16(self.embed) if self.cpu_bf16 else self.embed
        else:
            self.lm_head = product(tensors["output.weight"])
        # HF casts sqrt(hidden) to the weights' dtype (55.4256 -> 55.5 in bf16); so do we.
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype, device=device)
        self.final_norm = norm("output_norm.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"blk.{i}."
            self.layers.append({
                "attn_norm": norm(p + "attn_norm.weight"),
                # Q, K and V in one product: [q_size + 2 * kv_size, hidden]
                "qkv": product(torch.cat([tensors[p + "attn_q.weight"],
                                          tensors[p + "attn_k.weight"],
                                          tensors[p + "attn_v.weight"]])),
                "q_norm": norm(p + "attn_q_norm.weight"),  # [head_dim]
                "k_norm": norm(p + "attn_k_norm.weight"),  # [head_dim]
                "o": product(tensors[p + "attn_output.weight"]),
                "post_attn_norm": norm(p + "post_attention_norm.weight"),
                "ffn_norm": norm(p + "ffn_norm.weight"),
                "gate_up": product(torch.cat([tensors[p + "ffn_gate.weight"],
                                              tensors[p + "ffn_up.weight"]])),
                "down": product(tensors[p + "ffn_down.weight"]),
                "post_ffn_norm": norm(p + "post_ffw_norm.weight"),
                "local": cfg.layer_is_local(i),
                "sliding_window": cfg.layer_sliding_window(i),
            })
        self.rope_global = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta,
                                           device, torch.float32)
        self.rope_local = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_local_theta,
                                          device, torch.float32)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Gemma's RMSNorm runs in fp32 and casts back (its activations outgrow fp16)."""
        return rms_norm(x.float(), weight, self.cfg.rms_norm_eps).to(x.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:  # [T, hidden]
        cfg = self.cfg
        T = input_ids.shape[0]
        det = meta.deterministic
        h = self.embed[input_ids] * self.embed_scale
        cos_sin_local = self.rope_local.cos_sin(positions)
        cos_sin_global = self.rope_global.cos_sin(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            window = layer["sliding_window"]
            cos_sin = cos_sin_local if layer["local"] else cos_sin_global
            x = self._norm(h, layer["attn_norm"])
            q, k, v = linear(x, layer["qkv"], det).split(
                [self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self._norm(q.reshape(T, cfg.num_heads, cfg.head_dim), layer["q_norm"])
            k = self._norm(k.reshape(T, cfg.num_kv_heads, cfg.head_dim), layer["k_norm"])
            q = RotaryEmbedding.rotate(q, cos_sin).to(h.dtype)
            k = RotaryEmbedding.rotate(k, cos_sin).to(h.dtype)
            v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
            attn = paged_attention_layer(q, k, v, kv_cache, meta, cfg.attn_scale, window,
                                         self.use_triton, det)
            attn = linear(attn.reshape(T, self.q_size), layer["o"], det)
            h = h + self._norm(attn, layer["post_attn_norm"])
            x = self._norm(h, layer["ffn_norm"])
            gate, up = linear(x, layer["gate_up"], det).chunk(2, dim=-1)
            mlp = linear(gelu_tanh_and_mul(gate, up), layer["down"], det)
            h = h + self._norm(mlp, layer["post_ffn_norm"])
        return self._norm(h, self.final_norm)

    def compute_logits(self, hidden: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in fp32, soft-capped if the model asks."""
        logits = linear(hidden, self.lm_head, deterministic).float()
        cap = self.cfg.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


Model = Gemma3Model
