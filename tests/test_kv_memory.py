"""The KV pool sized from GPU memory (`--gpu-memory-utilization`): within budget, tight to a
block, refused when not one context fits; the per-token figure is what the backend allocates."""

import pytest
import torch

from kiln.runtime.backends.dense import DenseBackend
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.kv.memory import (
    kv_bytes_per_token,
    kv_cache_tokens_for_memory,
    step_activation_bytes,
)
from kiln.runtime.models.config import ModelConfig

SMOLLM2 = ModelConfig(arch="llama", num_layers=30, hidden_size=576, intermediate_size=1536,
                      num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152,
                      max_position=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=True)
CONFIG = EngineConfig(ctx_len=8192, prefill_chunk_len=2048, kv_cache_tokens=0, max_num_seqs=256)
GIB = 1 << 30
H200 = 141 * GIB


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bytes_per_token_is_what_the_backend_allocates(dtype):
    backend = DenseBackend("cpu", dtype)
    blocks = 4
    keys, values = backend.kv_cache(blocks, 16, SMOLLM2.num_kv_heads, SMOLLM2.head_dim)
    per_layer = (keys.nbytes + values.nbytes) / (blocks * 16)
    assert kv_bytes_per_token(SMOLLM2, dtype.itemsize) == per_layer * SMOLLM2.num_layers


@pytest.mark.parametrize("utilization", [0.5, 0.9, 1.0])
def test_pool_fills_the_budget_to_a_block(utilization):
    in_use = 2 * GIB  # weights, CUDA context
    tokens = kv_cache_tokens_for_memory(H200 - in_use, H200, utilization, SMOLLM2, CONFIG, 2)
    assert tokens % CONFIG.block_size == 0
    spent = in_use + step_activation_bytes(SMOLLM2, CONFIG, 2) + tokens * kv_bytes_per_token(
        SMOLLM2, 2)
    budget = int(H200 * utilization)
    assert spent <= budget < spent + CONFIG.block_size * kv_bytes_per_token(SMOLLM2, 2)


def test_other_processes_memory_is_not_ours():
    alone = kv_cache_tokens_for_memory(H200 - 2 * GIB, H200, 0.9, SMOLLM2, CONFIG, 2)
    shared = kv_cache_tokens_for_memory(H200 - 42 * GIB, H200, 0.9, SMOLLM2, CONFIG, 2)
    assert alone - shared == pytest.approx(40 * GIB / kv_bytes_per_token(SMOLLM2, 2), abs=16)


def test_refused_when_not_one_context_fits():
    with pytest.raises(ValueError, match="less than one 8192-token context"):
        kv_cache_tokens_for_memory(GIB, 16 * GIB, 0.9, SMOLLM2, CONFIG, 2)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu-memory-utilization"):
            kv_cache_tokens_for_memory(H200, H200, bad, SMOLLM2, CONFIG, 2)
