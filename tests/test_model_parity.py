"""kiln's llama forward against transformers' model loaded from the same GGUF (fp32).

The transformers outputs are stored in tests/golden/ by tests/make_golden.py.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime import cpu_blas
from runtime.attention_metadata import AttentionMetadata
from runtime.gguf_loader import load_tensors, open_gguf
from runtime.models.llama import LlamaModel, read_config

GOLDEN = Path(__file__).parent / "golden"
LOGITS_ATOL = 1e-3  # measured: about 5e-5 on all three prompts


@pytest.fixture(scope="module")
def model(smollm2_gguf):
    gf = open_gguf(smollm2_gguf)
    cfg = read_config(gf)
    return LlamaModel(cfg, load_tensors(gf), "cpu", torch.float32)


@pytest.fixture(scope="module")
def golden(smollm2_gguf):
    stem = Path(smollm2_gguf).stem
    return (json.loads((GOLDEN / f"{stem}.json").read_text()),
            np.load(GOLDEN / f"{stem}.npz"))


def _prefill(model, ids, num_blocks=64):
    cfg = model.cfg
    kv = [(torch.zeros(num_blocks, 16, cfg.num_kv_heads, cfg.head_dim),
           torch.zeros(num_blocks, 16, cfg.num_kv_heads, cfg.head_dim))
          for _ in range(cfg.num_layers)]
    T = len(ids)
    # Scrambled physical blocks: the forward must follow the block table.
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).int()
    slots = torch.tensor([int(table[p // 16]) * 16 + p % 16 for p in range(T)])
    meta = AttentionMetadata(torch.tensor([0, T], dtype=torch.int32),
                             torch.tensor([T], dtype=torch.int32), table[None], slots, T, T)
    with torch.inference_mode():
        h = model.forward(torch.tensor(ids), torch.arange(T), meta, kv)
        return model.compute_logits(h[-1:])[0]


@pytest.fixture(params=["openblas", "mkl"])
def cpu_products(request):
    """Each library runtime/cpu_blas.py may pick for a batch does the products."""
    cpu_blas.set_policy(request.param)
    cpu_blas.for_batch(2, 2)
    yield request.param
    cpu_blas.set_policy("openblas")
    torch.set_num_threads(1)


@pytest.mark.parametrize("case", [0, 1, 2])
def test_last_position_logits_match_transformers(model, golden, case, cpu_products):
    cases, arrays = golden
    ref = torch.from_numpy(arrays[f"logits_{case}"])
    logits = _prefill(model, cases[case]["prompt_ids"])
    diff = (logits - ref).abs().max().item()
    assert diff < LOGITS_ATOL, f"max abs diff {diff}"
    assert logits.topk(10).indices.tolist() == ref.topk(10).indices.tolist()
