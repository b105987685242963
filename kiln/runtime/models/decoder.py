"""The one forward of the decoder-only families: pre-norm blocks of GQA attention over the
paged KV cache and a gated MLP, with the variations the families need as configuration
(QK-norm, Gemma's sandwich norms and scaled embedding, per-layer RoPE base and sliding
window, final logit soft-capping). Every operation goes through the model's backend
(runtime/backends), which owns the weights' form and the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.runtime.backends import RopeTable
from kiln.runtime.kv.attention_metadata import AttentionMetadata
from kiln.runtime.models.config import ModelConfig


@dataclass
class DecoderLayer:
    attn_norm: torch.Tensor  # [hidden]
    qkv: object  # Q, K and V stacked: [hidden] -> [(heads + 2 * kv_heads) * head_dim]
    o: object  # [heads * head_dim] -> [hidden]
    ffn_norm: torch.Tensor
    gate_up: object  # gate and up stacked: [hidden] -> [2 * intermediate]
    down: object  # [intermediate] -> [hidden]
    rope: RopeTable
    sliding_window: int = 0
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None


class DecoderModel:
    def __init__(self, cfg: ModelConfig, backend, embed, layers: list[DecoderLayer],
                 final_norm: torch.Tensor, lm_head):
        self.cfg, self.backend = cfg, backend
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:  # [T, hidden]
        cfg, be = self.cfg, self.backend
        T, H, KVH, D = input_ids.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        h = self.embed(input_ids)
        if cfg.embedding_scale != 1.0:
            h = h * torch.tensor(cfg.embedding_scale, dtype=h.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            qkv = layer.qkv(be.rms_norm(h, layer.attn_norm, eps))
            # Views into the one product: [T, heads, head_dim] each, tokens qkv's rows apart.
            q = qkv[:, :self.q_size].view(T, H, D)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, KVH, D)
            v = qkv[:, self.q_size + self.kv_size:].view(T, KVH, D)
            if layer.q_norm is not None:
                be.rms_norm_heads_(q, layer.q_norm, eps)
                be.rms_norm_heads_(k, layer.k_norm, eps)
            # Q and K sit side by side in the product: rotate them as one run of heads.
            be.rope_(qkv[:, :self.q_size + self.kv_size].view(T, H + KVH, D), positions,
                     layer.rope)
            attn = be.attention(q, k, v, kv_cache, meta, cfg.attn_scale, layer.sliding_window)
            out = layer.o(attn)
            if layer.post_attn_norm is not None:
                out = be.rms_norm(out, layer.post_attn_norm, eps)
            h.add_(out)
            mlp = layer.down(be.act_mul(layer.gate_up(be.rms_norm(h, layer.ffn_norm, eps)),
                                        cfg.activation))
            if layer.post_ffn_norm is not None:
                mlp = be.rms_norm(mlp, layer.post_ffn_norm, eps)
            h.add_(mlp)
        return be.rms_norm(h, self.final_norm, eps)

    @property
    def logits_dtype(self) -> torch.dtype:
        """The LM head's dtype; fp32 where the model soft-caps (tanh in fp32)."""
        return torch.float32 if self.cfg.final_logit_softcap else self.backend.dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in logits_dtype (the sampler reads bf16
        as it is), soft-capped if the model asks."""
        logits = self.lm_head(hidden.contiguous())
        cap = self.cfg.final_logit_softcap
        if cap:
            logits = torch.tanh(logits.float() / cap) * cap
        return logits
