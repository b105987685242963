"""Llama (SmolLM2 and friends): RMSNorm, RoPE, GQA attention over the paged cache, SwiGLU."""

from __future__ import annotations

import numpy as np
import torch

from runtime.attention_metadata import AttentionMetadata
from runtime.config import ModelConfig
from runtime.gguf_loader import GGUFFile
from runtime.layers import (
    RotaryEmbedding,
    linear,
    matmul_np,
    paged_attention_layer,
    rms_norm,
    rms_norm_np,
    silu_and_mul,
)
from runtime.packed_linear import PackedBf16, packs_weights, product_weight
from runtime.quant_linear import MAX_ROWS, QuantLinear, block_weight

# load_model hands this architecture the GGUF's tensors too (runtime/quant_linear.py).
READS_GGUF_BLOCKS = True


def read_config(gf: GGUFFile) -> ModelConfig:
    num_heads = int(gf.arch_field("attention.head_count"))
    hidden = int(gf.arch_field("embedding_length"))
    vocab = gf.arch_field("vocab_size") or len(gf.field("tokenizer.ggml.tokens"))
    tensor_names = {t.name for t in gf.reader.tensors}
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
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter interleaves the q/k rows for its RoPE; undo it (HF order)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _numpy_view(t: torch.Tensor | PackedBf16) -> np.ndarray | PackedBf16:
    """A product's weight as matmul_np takes it ([in, out] view, or packed as it is)."""
    if isinstance(t, PackedBf16):
        return t
    return t.numpy().T if t.dim() == 2 else t.numpy()


class LlamaModel:
    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], device, dtype,
                 use_triton: bool = False, gguf_blocks: dict | None = None):
        """gguf_blocks: the GGUF's tensors by name (gguf.ReaderTensor), for the products that
        read their blocks (runtime/quant_linear.py) in the numpy forward; None: fp32 only."""
        self.cfg, self.use_triton = cfg, use_triton
        on_cpu = torch.device(device).type == "cpu" and not use_triton
        # bf16 on the CPU: fp32 activations, the products' weights packed for oneDNN.
        self.cpu_bf16 = packs_weights(device, dtype, use_triton)
        if self.cpu_bf16:
            dtype = torch.float32

        def w(name: str) -> torch.Tensor:
            return tensors[name].to(device=device, dtype=dtype).contiguous()

        def product(weight: torch.Tensor) -> torch.Tensor | PackedBf16:  # [out, in]
            return product_weight(weight, device, dtype, self.cpu_bf16)

        self.embed = w("token_embd.weight")  # [vocab, hidden]
        if cfg.tie_word_embeddings:  # fp32: the same tensor; bf16: a packed copy of it
            self.lm_head = PackedBf16(self.embed) if self.cpu_bf16 else self.embed
        else:
            self.lm_head = product(tensors["output.weight"])
        self.final_norm = w("output_norm.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"blk.{i}."
            q = _unpermute_rope(tensors[p + "attn_q.weight"], cfg.num_heads)
            k = _unpermute_rope(tensors[p + "attn_k.weight"], cfg.num_kv_heads)
            v = tensors[p + "attn_v.weight"]
            self.layers.append({
                "attn_norm": w(p + "attn_norm.weight"),
                # Q, K and V in one product: [q_size + 2 * kv_size, hidden]
                "qkv": product(torch.cat([q, k, v])),
                "o": product(tensors[p + "attn_output.weight"]),
                "ffn_norm": w(p + "ffn_norm.weight"),
                "gate_up": product(torch.cat([tensors[p + "ffn_gate.weight"],
                                              tensors[p + "ffn_up.weight"]])),
                "down": product(tensors[p + "ffn_down.weight"]),
            })
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, device,
                                    torch.float32)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # The CPU forward (fp32 activations) runs on numpy views of the same weights (no
        # copies), or on the packed bf16 ones.
        self.numpy_forward = on_cpu and dtype == torch.float32
        self.lm_head_blocks: QuantLinear | None = None
        self.block_rows = 0  # steps of up to this many rows read GGUF blocks (cpu_blas)
        if self.numpy_forward:
            for layer in self.layers:
                layer["np"] = {name: _numpy_view(t) for name, t in layer.items()}
            if gguf_blocks is not None:
                self._attach_blocks(gguf_blocks)

    def _attach_blocks(self, gguf: dict) -> None:
        """Give each product whose GGUF tensors have a block kernel both weights."""
        cfg = self.cfg

        def attach(weight_t: np.ndarray, names: list[str], permute=None):
            blocks = block_weight([gguf[n] for n in names], permute)
            return weight_t if blocks is None else QuantLinear(blocks, weight_t)

        rope_q = lambda t: _unpermute_rope(t, cfg.num_heads)  # as the fp32 copy was
        rope_k = lambda t: _unpermute_rope(t, cfg.num_kv_heads)
        for i, layer in enumerate(self.layers):
            p, w = f"blk.{i}.", layer["np"]
            w["qkv"] = attach(w["qkv"], [p + "attn_q.weight", p + "attn_k.weight",
                                         p + "attn_v.weight"], [rope_q, rope_k, None])
            w["o"] = attach(w["o"], [p + "attn_output.weight"])
            w["gate_up"] = attach(w["gate_up"], [p + "ffn_gate.weight", p + "ffn_up.weight"])
            w["down"] = attach(w["down"], [p + "ffn_down.weight"])
        head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
        lm_head = attach(self.lm_head.numpy().T, [head])
        if isinstance(lm_head, QuantLinear):
            self.lm_head_blocks = lm_head
        if self.lm_head_blocks is not None or any(
                isinstance(t, QuantLinear) for layer in self.layers for t in layer["np"].values()):
            self.block_rows = MAX_ROWS

    def _forward_numpy(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:  # [T, hidden]
        """`forward` with the residual stream in numpy between the attention calls: the
        same products in fewer library calls per layer, each cheaper than torch's on tiny
        tensors. Measured against `forward` (bench/decode_step.py, alternating, one
        session): 38.0 vs 40.4 and 35.7 vs 37.7 ms a step at batch 1, 138 vs 154 and 141
        vs 147 ms at batch 16."""
        cfg = self.cfg
        T, D, H, KVH = input_ids.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        det = meta.deterministic
        eps, half = np.float32(cfg.rms_norm_eps), D // 2
        h = self.embed.numpy()[input_ids.numpy()]
        pos = positions.numpy()
        cos, sin = self.rope.cos.numpy()[pos][:, None], self.rope.sin.numpy()[pos][:, None]
        qk_size = self.q_size + self.kv_size
        for layer, kv_cache in zip(self.layers, kv_caches):
            w = layer["np"]
            qkv = matmul_np(rms_norm_np(h, w["attn_norm"], eps), w["qkv"], det)
            qk = qkv[:, :qk_size].reshape(T, H + KVH, D)
            x1, x2 = qk[..., :half], qk[..., half:]
            qk = np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)
            v = np.ascontiguousarray(qkv[:, qk_size:]).reshape(T, KVH, D)
            attn = paged_attention_layer(torch.from_numpy(qk[:, :H]), torch.from_numpy(qk[:, H:]),
                                         torch.from_numpy(v), kv_cache, meta, cfg.attn_scale, 0,
                                         False, det).numpy()
            h = h + matmul_np(attn.reshape(T, self.q_size), w["o"], det)
            gate_up = torch.from_numpy(
                matmul_np(rms_norm_np(h, w["ffn_norm"], eps), w["gate_up"], det))
            act = silu_and_mul(*gate_up.chunk(2, dim=-1)).numpy()
            h = h + matmul_np(act, w["down"], det)
        return torch.from_numpy(rms_norm_np(h, self.final_norm.numpy(), eps))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:  # [T, hidden]
        if self.numpy_forward:
            return self._forward_numpy(input_ids, positions, meta, kv_caches)
        cfg = self.cfg
        T = input_ids.shape[0]
        det = meta.deterministic
        h = self.embed[input_ids]
        cos_sin = self.rope.cos_sin(positions)
        heads = cfg.num_heads + cfg.num_kv_heads
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = rms_norm(h, layer["attn_norm"], cfg.rms_norm_eps)
            qkv = linear(x, layer["qkv"], det)
            # Q and K sit side by side in the product: rotate them as one tensor.
            qk = self.rope.rotate(qkv[:, :self.q_size + self.kv_size].view(T, heads, -1),
                                  cos_sin).to(h.dtype)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size:].view(T, cfg.num_kv_heads, cfg.head_dim)
            attn = paged_attention_layer(q, k, v, kv_cache, meta, cfg.attn_scale, 0,
                                         self.use_triton, det)
            h = h + linear(attn.reshape(T, self.q_size), layer["o"], det)
            x = rms_norm(h, layer["ffn_norm"], cfg.rms_norm_eps)
            gate, up = linear(x, layer["gate_up"], det).chunk(2, dim=-1)
            h = h + linear(silu_and_mul(gate, up), layer["down"], det)
        return rms_norm(h, self.final_norm, cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in fp32."""
        if self.lm_head_blocks is not None:
            return torch.from_numpy(matmul_np(hidden.numpy(), self.lm_head_blocks, deterministic))
        return linear(hidden, self.lm_head, deterministic).float()
Model = LlamaModel
