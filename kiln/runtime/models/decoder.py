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

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:  # [T, hidden]
        """The forward as its pieces: the token-wise work between two attentions is one
        piece (what engine/piecewise_graphs.py captures), attention runs between them."""
        h = self.embed_tokens(input_ids)
        out = self.first_projection(h)
        for i, kv_cache in enumerate(kv_caches):
            q = self.rope_store_kv(i, out, positions, meta.slot_mapping, kv_cache)
            out = self.after_attention(i, h, self.attend(i, q, meta, kv_cache))
        return out

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        """The residual stream h, which each after_attention then updates in place."""
        h = self.embed(input_ids)
        if self.cfg.embedding_scale != 1.0:
            h = h * torch.tensor(self.cfg.embedding_scale, dtype=h.dtype)
        return h

    def first_projection(self, h: torch.Tensor) -> torch.Tensor:  # [T, (H + 2 KVH) * D]
        return self.layers[0].qkv(self.backend.rms_norm(h, self.layers[0].attn_norm,
                                                        self.cfg.rms_norm_eps))

    def rope_store_kv(self, i: int, qkv: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]
                      ) -> torch.Tensor:  # [T, H, D]: q, a view of qkv
        """Layer i's QKV product: q and k normalised (QK-norm) and rotated, k and v stored
        through the slot mapping -> q."""
        cfg, layer = self.cfg, self.layers[i]
        T, H, KVH = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads
        # Views into the one product: [T, heads, head_dim] each, tokens qkv's rows apart
        # (one view and one split: half the host time of three slices and views).
        q, k, v = qkv.view(T, H + 2 * KVH, cfg.head_dim).split((H, KVH, KVH), dim=1)
        qk_norm = (layer.q_norm, layer.k_norm, cfg.rms_norm_eps) \
            if layer.q_norm is not None else None
        self.backend.rope_store_kv(q, k, v, kv_cache, slot_mapping, positions, layer.rope,
                                   qk_norm)
        return q

    def attend(self, i: int, q: torch.Tensor, meta: AttentionMetadata,
               kv_cache: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor | None = None
               ) -> torch.Tensor:  # [T, H * D]
        """Layer i's attention (into out if given: [T, H * D])."""
        layer = self.layers[i]
        return self.backend.attention(q, kv_cache, meta, self.cfg.attn_scale,
                                      layer.sliding_window, out)

    def after_attention(self, i: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Layer i from its attention's output on: the next layer's QKV product, or the last
        layer's normalised output [T, hidden]. The residual stream h takes each sublayer's
        output in the call that normalises it for the next sublayer (Gemma's norm of that
        output too): one kernel on the GPU."""
        be, layer, eps = self.backend, self.layers[i], self.cfg.rms_norm_eps
        x = be.add_rms_norm(h, layer.o(attn), layer.ffn_norm, eps, layer.post_attn_norm)
        mlp = layer.down(be.act_mul(layer.gate_up(x), self.cfg.activation))
        last = i + 1 == len(self.layers)
        x = be.add_rms_norm(h, mlp, self.final_norm if last else self.layers[i + 1].attn_norm,
                            eps, layer.post_ffn_norm)
        return x if last else self.layers[i + 1].qkv(x)

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
