"""How many KV-cache tokens fit on a GPU (`--gpu-memory-utilization`, vLLM's meaning: the
fraction of the GPU's whole memory this engine may hold, weights and all).

The weights are loaded first, so what the GPU reports free then has them (and the CUDA
context, and any other process) taken out. A step's transient memory is estimated from the
model's shapes at the engine's largest step rather than profiled: the estimate errs high.
"""

from __future__ import annotations

from kiln.kernels.attention import PARTITION_SIZE
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.piecewise_graphs import MAX_TOKENS
from kiln.runtime.models.config import ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def step_activation_bytes(cfg: ModelConfig, config: EngineConfig, dtype_bytes: int) -> int:
    """An upper estimate of one step's transient memory at the engine's largest step."""
    T, S = config.token_budget, config.max_num_seqs
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    # Live at once in a layer: the residual, its fp32 norm, QKV, attention out, gate/up, act.
    per_token = (2 * cfg.hidden_size + qkv + cfg.num_heads * cfg.head_dim
                 + 3 * cfg.intermediate_size) * dtype_bytes + 4 * cfg.hidden_size
    partitions = -(-config.ctx_len // PARTITION_SIZE)
    head_dim_padded = 1 << (cfg.head_dim - 1).bit_length()
    split_kv = T * cfg.num_heads * partitions * (head_dim_padded + 2) * 4
    # Logits (and their fp32 copy when soft-capped), the sampler's fp32 work and int32 counts.
    sampler = S * cfg.vocab_size * (dtype_bytes + 4 + 4 + 4)
    # The piecewise graphs hold each piece's output (a layer's QKV product) at every bucket
    # (their sizes sum to under twice the largest), beside the residual stream, the final
    # states and attention's output; the decode graphs' pool, the largest bucket's logits
    # and the sampler's scratch beside them (its penalised row and counts).
    held = 2 * MAX_TOKENS * (cfg.num_layers * qkv + 2 * cfg.hidden_size
                             + cfg.num_heads * cfg.head_dim) * dtype_bytes \
        + S * cfg.vocab_size * (dtype_bytes + 4 + 4) if config.cuda_graphs else 0
    # 2x: allocator slack, torch temporaries
    return 2 * (T * per_token + split_kv + sampler) + held


def kv_cache_tokens_for_memory(free: int, total: int, utilization: float, cfg: ModelConfig,
                               config: EngineConfig, dtype_bytes: int) -> int:
    """KV tokens (whole blocks) that fit in total * utilization, less what is in use now and
    a step's activations. Raises ValueError if not even one context fits."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization {utilization} must be in (0, 1]")
    in_use = total - free
    budget = int(total * utilization) - in_use - step_activation_bytes(cfg, config, dtype_bytes)
    per_token = kv_bytes_per_token(cfg, dtype_bytes)
    tokens = max(budget, 0) // per_token // config.block_size * config.block_size
    if tokens < config.ctx_len:
        gib = 1 << 30
        raise ValueError(
            f"the KV cache would hold {tokens} tokens, less than one {config.ctx_len}-token "
            f"context: {in_use / gib:.1f} GiB of {total / gib:.1f} GiB is in use and "
            f"--gpu-memory-utilization {utilization} allows {total * utilization / gib:.1f} "
            f"GiB; raise it, or lower --ctx-len or --max-num-seqs")
    return tokens
