"""Every kernel variant a model's steps launch, as launches on dummy tensors of its shapes.

Run once at load on CUDA, so that no reply stalls every stream on a mid-step compile; the
ahead-of-time compile test (kernels/aot.py) records the same launches and compiles them for
sm_90 and sm_80 on the CPU. A variant is fixed by the constexprs and the specialisations of
the arguments the launchers do not mark do_not_specialize: the model's shapes, the dtype,
and per kernel a few features (sliding window, split-KV, penalties, grammar, a bias).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.kernels import BLOCK_SIZE
from kiln.kernels.activation import act_mul
from kiln.kernels.attention import PARTITION_SIZE, TILE_ROWS, paged_attention, prefill_tiles
from kiln.kernels.kv_cache import rope_store_kvcache
from kiln.kernels.matmul import matmul
from kiln.kernels.rms_norm import add_rms_norm, rms_norm
from kiln.kernels.sampling import sample
from kiln.kernels.sampling_metadata import SamplingMetadata


@dataclass(frozen=True)
class KernelShapes:
    """What of a model the kernels' variants depend on."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    rotary_dim: int
    activation: str = "silu"
    qk_norm: bool = False  # an RMSNorm over each query and key head (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # a norm of each sublayer's output too (Gemma)
    sliding_windows: tuple[int, ...] = (0,)  # the distinct windows of its layers; 0 = none
    block_size: int = BLOCK_SIZE
    qkv_bias: bool = False  # Qwen2's

    @staticmethod
    def of(model) -> KernelShapes:
        """From a DecoderModel: its config, and the norms its layers hold."""
        cfg, layer = model.cfg, model.layers[0]
        windows = sorted({cfg.layer_sliding_window(i) for i in range(cfg.num_layers)})
        return KernelShapes(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size,
                            cfg.hidden_size, cfg.intermediate_size, cfg.rotary_dim,
                            cfg.activation, layer.q_norm is not None,
                            layer.post_attn_norm is not None, tuple(windows),
                            qkv_bias=layer.qkv.bias is not None)


def _product_launches(shapes: KernelShapes, dtype: torch.dtype, device: torch.device | str
                      ) -> list[tuple[str, Callable[[], None]]]:
    """kernels/matmul.py at each weight's (outputs, inputs): Q, K and V together (with
    Qwen2's bias), the attention's output, gate and up together, down, the LM head."""
    H, KVH, D = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim
    hidden, inter = shapes.hidden_size, shapes.intermediate_size
    weights = [("qkv", (H + 2 * KVH) * D, hidden, shapes.qkv_bias), ("o", hidden, H * D, False),
               ("gate_up", 2 * inter, hidden, False), ("down", hidden, inter, False),
               ("lm_head", shapes.vocab_size, hidden, False)]

    def product(n: int, k: int, bias: bool):
        def launch():
            # empty: a launch reads only the shapes (and the LM head's are large)
            w = torch.empty((n, k), dtype=dtype, device=device)
            b = torch.zeros(n, dtype=dtype, device=device) if bias else None
            matmul(torch.zeros((1, k), dtype=dtype, device=device), w, b)
        return launch

    return [(f"matmul {name}", product(n, k, bias)) for name, n, k, bias in weights]


def warmup_launches(shapes: KernelShapes, dtype: torch.dtype, logits_dtype: torch.dtype,
                    device: torch.device | str, batch_invariant: bool = True,
                    attention_rows: int = TILE_ROWS) -> list[tuple[str, Callable[[], None]]]:
    """(name, launch) for every variant: the batch-invariant products of each weight's
    shape (where the backend uses them); the norms and the gated activation; the KV store
    (with QK-norm and RoPE) and attention at each window, split and not (its tiles of
    attention_rows query rows: another than the default only for aot.py's reports); the
    sampler with and without penalties and grammar."""
    H, KVH, D, bs = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, shapes.block_size
    hidden = torch.zeros((1, shapes.hidden_size), dtype=dtype, device=device)
    norm_weight = torch.ones(shapes.hidden_size, dtype=torch.float32, device=device)
    gate_up = torch.zeros((1, 2 * shapes.intermediate_size), dtype=dtype, device=device)
    delta_weight = norm_weight if shapes.sandwich_norms else None
    launches = _product_launches(shapes, dtype, device) if batch_invariant else []
    launches += [
        ("rms_norm", lambda: rms_norm(hidden, norm_weight, 1e-6)),
        ("add_rms_norm", lambda: add_rms_norm(hidden, hidden.clone(), norm_weight, 1e-6,
                                              delta_weight)),
        (f"act_mul {shapes.activation}", lambda: act_mul(gate_up, shapes.activation)),
    ]
    angles = torch.zeros((2, shapes.rotary_dim // 2), dtype=torch.float32, device=device)
    head_norm = torch.ones(D, dtype=torch.float32, device=device)
    qk_norm = (head_norm, head_norm, 1e-6) if shapes.qk_norm else None
    positions = torch.zeros(1, dtype=torch.int64, device=device)
    seq_len = PARTITION_SIZE + 1  # one key past a partition: the split variant
    num_blocks = -(-seq_len // bs)
    key_cache = torch.zeros((num_blocks, bs, KVH, D), dtype=dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    # Q, K and V as views of one product, as the forward makes them.
    qkv = torch.zeros((1, (H + 2 * KVH) * D), dtype=dtype, device=device)
    q = qkv[:, :H * D].view(1, H, D)
    k = qkv[:, H * D:(H + KVH) * D].view(1, KVH, D)
    v = qkv[:, (H + KVH) * D:].view(1, KVH, D)
    block_tables = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
    slot_mapping = torch.zeros(1, dtype=torch.int64, device=device)

    def attention(window: int, length: int, query_len: int | None, tiles: int | None):
        seq_lens = torch.tensor([length], dtype=torch.int32, device=device)

        def launch():
            rope_store_kvcache(q, k, v, key_cache, value_cache, slot_mapping, positions,
                               angles, angles, qk_norm)
            paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                            D ** -0.5, sliding_window=window, max_seq_len=length,
                            max_query_len=query_len, tiles=tiles, rows=attention_rows)
        return launch

    # The decode grid (steps of one token a sequence), the general one, and the general one
    # with programs of several query tiles (prefill steps with long chunks).
    grids = [("decode", 1, None), ("general", None, 1),
             ("prefill", None, prefill_tiles(D, dtype, attention_rows))]
    launches += [(f"attention window={w} split={length > PARTITION_SIZE} grid={grid}",
                  attention(w, length, query_len, tiles))
                 for w in shapes.sliding_windows for length in (1, seq_len)
                 for grid, query_len, tiles in grids]

    B, V = 2, shapes.vocab_size
    logits = torch.zeros((B, V), dtype=logits_dtype, device=device)

    def sampler(penalties: bool, grammar: bool):
        def col(values, dt):
            return torch.tensor(values, dtype=dt, device=device)

        def launch():
            md = SamplingMetadata(
                temperature=col([0.0, 1.0], torch.float32), top_k=col([0, 5], torch.int32),
                top_p=col([1.0, 0.9], torch.float32), min_p=col([0.0, 0.1], torch.float32),
                repetition_penalty=col([1.0, 1.1], torch.float32),
                frequency_penalty=col([0.0, 0.5], torch.float32),
                presence_penalty=col([0.0, 0.5], torch.float32),
                window_token_ids=col([[1, 2], [3, -1]], torch.int64) if penalties else None,
                seeds=col([0, 1], torch.int64), offsets=col([0, 0], torch.int64),
                grammar_bitmask=torch.full((B, -(-V // 32)), -1, dtype=torch.int32,
                                           device=device) if grammar else None,
                num_top_logprobs=1, flags=(True, True, True, False))
            sample(logits, md)
        return launch

    launches += [(f"sampler penalties={p} grammar={g}", sampler(p, g))
                 for p in (False, True) for g in (False, True)]
    return launches
