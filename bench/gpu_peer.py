"""The peer bench/gpu_check.py times kiln's decode step against: torch.compile of a llama of
the same shapes and random weights, gpt-fast's recipe (a static KV cache, one compiled
decode step with its sampling, `fullgraph=True`): what a user without a serving engine would
pick. It has no scheduler, no paging and no batch-invariance; it decodes every row at one
position.

On the CPU (gpu_check's dry run) it compiles with backend="eager", which checks the model
traces as one graph, not its speed.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


class StaticLlama(torch.nn.Module):
    def __init__(self, shape, batch: int, max_len: int, device: str, dtype: torch.dtype):
        super().__init__()
        layers, hidden, inter, heads, kv_heads, head_dim, vocab = shape
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        g = torch.Generator(device="cpu").manual_seed(0)

        def weights(n: int, *size) -> torch.nn.ParameterList:
            return torch.nn.ParameterList(
                torch.nn.Parameter((torch.randn(size, generator=g) * 0.02).to(device, dtype),
                                   requires_grad=False) for _ in range(n))
        self.embed, self.lm_head = weights(1, vocab, hidden)[0], weights(1, vocab, hidden)[0]
        self.wqkv = weights(layers, (heads + 2 * kv_heads) * head_dim, hidden)
        self.wo = weights(layers, hidden, heads * head_dim)
        self.w13 = weights(layers, 2 * inter, hidden)
        self.w2 = weights(layers, hidden, inter)
        # Buffers, so the compiled step (and its CUDA graphs) takes them as static inputs.
        self.register_buffer("norms", torch.ones((2 * layers, hidden), device=device,
                                                 dtype=dtype))
        self.register_buffer("final_norm", torch.ones(hidden, device=device, dtype=dtype))
        cache = (layers, batch, kv_heads, max_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache, device=device, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(cache, device=device, dtype=dtype))
        freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
        angles = torch.outer(torch.arange(max_len, device=device), freqs)  # [max_len, D / 2]
        self.register_buffer("cos", angles.cos().to(dtype))
        self.register_buffer("sin", angles.sin().to(dtype))
        self.register_buffer("mask", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool,
                                                           device=device)))

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x: [B, H, 1, D]
        x1, x2 = x.chunk(2, dim=-1)
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]  # [1, 1, 1, D / 2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, temperature: float
                ) -> torch.Tensor:  # tokens: [B, 1], pos: [1] -> next tokens [B, 1]
        B = tokens.shape[0]
        H, KVH, D = self.heads, self.kv_heads, self.head_dim
        x = self.embed[tokens]  # [B, 1, hidden]
        for i in range(len(self.wqkv)):
            q, k, v = F.linear(F.rms_norm(x, x.shape[-1:], self.norms[2 * i]), self.wqkv[i]
                               ).split([H * D, KVH * D, KVH * D], dim=-1)
            q = self.rope(q.view(B, 1, H, D).transpose(1, 2), pos)
            k = self.rope(k.view(B, 1, KVH, D).transpose(1, 2), pos)
            self.k_cache[i].index_copy_(2, pos, k)
            self.v_cache[i].index_copy_(2, pos, v.view(B, 1, KVH, D).transpose(1, 2))
            attn = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i],
                                                  attn_mask=self.mask[pos][None, None],
                                                  enable_gqa=True)
            x = x + F.linear(attn.transpose(1, 2).reshape(B, 1, H * D), self.wo[i])
            gate, up = F.linear(F.rms_norm(x, x.shape[-1:], self.norms[2 * i + 1]),
                                self.w13[i]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, self.w2[i])
        logits = F.linear(F.rms_norm(x, x.shape[-1:], self.final_norm), self.lm_head)
        # gpt-fast's draw without a host sync: argmax of p / Exp(1).
        probs = torch.softmax(logits[:, -1].float() / temperature, dim=-1)
        return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1,
                            keepdim=True)


def time_compiled_decode(shape, label: str, batches, context: int, device: str, dry: bool,
                         line) -> None:
    """A decode step at `context` tokens for each batch size, compiled with max-autotune
    (eager backend on the CPU), timed over 48 steps after the compile's own."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    mode = "backend=eager" if dry else "max-autotune"
    for B in batches:
        model = StaticLlama(shape, B, context + 64, device, dtype)
        step = torch.compile(model.forward, fullgraph=True,
                             **({"backend": "eager"} if dry else {"mode": "max-autotune"}))
        tokens = torch.zeros((B, 1), dtype=torch.int64, device=device)
        pos = torch.tensor([context], device=device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(3):  # the compile, then CUDA graphs' warm-up
                tokens = step(tokens, pos, 0.8).clone()
            if device == "cuda":
                torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            steps = 2 if dry else 48
            t0 = time.perf_counter()
            for _ in range(steps):  # the host sees each step's tokens, as a server's does
                tokens = step(tokens, pos, 0.8).clone()
                tokens.cpu()
            ms = (time.perf_counter() - t0) / steps * 1000
        line(f"torch.compile decode step {label} batch {B}", ms, "ms",
             f"{B / ms * 1000:.0f} tok/s at {context} tokens ({mode}, gpt-fast's recipe; "
             f"compile {compile_s:.0f} s)")
        del model, step
