"""The GGUF-block products (runtime/csrc/quant_matmul.c) against an independent oracle: the
gguf package's own dequantization, multiplied in fp64."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from runtime import cpu_blas, quant_linear
from runtime.quant_linear import MAX_ROWS, QuantLinear, block_weight

pytestmark = pytest.mark.skipif(quant_linear.library() is None,
                                reason=f"no block kernel here: {quant_linear.library_error()}")


def _tensor(kind: str, rows: int, cols: int, seed: int):
    """A GGUF-like tensor: what gguf.GGUFReader gives (raw blocks, [rows, row bytes])."""
    w = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32) * 0.05
    qtype = GGMLQuantizationType[kind]
    raw = quants.quantize(w, qtype)
    return SimpleNamespace(data=raw, tensor_type=qtype)


def _oracle(tensors, x: np.ndarray) -> np.ndarray:
    w = np.concatenate([quants.dequantize(t.data, t.tensor_type) for t in tensors])
    return x.astype(np.float64) @ w.astype(np.float64).T


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 37])
def test_block_product_matches_dequantized_fp64(kind, rows):
    tensors = [_tensor(kind, 96, 576, 0), _tensor(kind, 40, 576, 1)]  # stacked, as qkv is
    bw = block_weight(tensors)
    assert bw.kind == kind and bw.shape == (136, 576)
    x = np.random.default_rng(rows).standard_normal((rows, 576), dtype=np.float32)
    y = bw.matmul(x)
    ref = _oracle(tensors, x)
    assert y.dtype == np.float32 and y.shape == (rows, 136)
    # fp32 sums of 576 products: the error of any fp32 order of additions
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_each_row_is_summed_the_same_whatever_the_batch():
    bw = block_weight([_tensor("Q4_1", 64, 1536, 2)])
    x = np.random.default_rng(3).standard_normal((13, 1536), dtype=np.float32)
    full = bw.matmul(x)
    for i in range(13):
        assert np.array_equal(bw.matmul(x[i:i + 1])[0], full[i])


def test_permuted_rows_follow_the_permutation():
    t = _tensor("Q4_1", 32, 576, 4)
    flip = lambda raw: raw.flip(0)  # noqa: E731
    bw = block_weight([t], [flip])
    x = np.random.default_rng(5).standard_normal((2, 576), dtype=np.float32)
    np.testing.assert_allclose(bw.matmul(x), _oracle([t], x)[:, ::-1], atol=1e-5)


def test_mixed_or_unsupported_types_keep_fp32():
    assert block_weight([_tensor("Q4_1", 32, 576, 0), _tensor("Q8_0", 32, 576, 0)]) is None
    assert block_weight([_tensor("Q5_0", 32, 576, 0)]) is None


def test_quant_linear_hands_big_or_deterministic_products_to_fp32():
    t = _tensor("Q8_0", 32, 576, 6)
    fp32_t = quants.dequantize(t.data, t.tensor_type).T
    ql = QuantLinear(block_weight([t]), fp32_t)
    assert ql.uses_blocks(1, False) and ql.uses_blocks(MAX_ROWS, False)
    assert not ql.uses_blocks(MAX_ROWS + 1, False)
    assert not ql.uses_blocks(1, True)


@pytest.fixture(scope="module")
def smollm():
    from runtime.model_loader import load_model

    with_blocks = load_model("smollm2:135m")
    fp32 = load_model("smollm2:135m", cpu_weights="fp32")
    yield with_blocks, fp32
    cpu_blas.set_policy("openblas")


@pytest.mark.slow
def test_smollm_reads_blocks_for_every_product(smollm):
    model = smollm[0].model
    assert model.block_rows == MAX_ROWS and model.lm_head_blocks.blocks.kind == "Q8_0"
    kinds = {w.blocks.kind for layer in model.layers for name, w in layer["np"].items()
             if name in ("qkv", "o", "gate_up", "down")}
    assert kinds == {"Q4_1"}
    assert smollm[1].model.block_rows == 0 and smollm[1].model.lm_head_blocks is None


@pytest.mark.slow
def test_smollm_engine_with_blocks_follows_fp32(smollm):
    """Greedy tokens and logprobs of the block products against the fp32 weights, through
    the engine: a prefill (fp32 BLAS), then decode steps of 1 and 3 rows (blocks)."""
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.sampling_params import SamplingParams

    results = []
    for loaded in smollm:
        cpu_blas.configure(loaded.model, "openblas")
        engine = LLMEngine(loaded, EngineConfig.build(loaded.ctx_len, loaded.max_prefill_len,
                                                      kv_cache_tokens=2048, max_num_seqs=4))
        tok = loaded.tokenizer
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
        reqs = [engine.make_request(f"r{i}", tok.encode(p), SamplingParams(temperature=0.0),
                                    max_tokens=12, ignore_eos=True, num_top_logprobs=0)
                for i, p in enumerate(prompts)]
        for r in reqs:
            engine.add_request(r)
        outs = {r.request_id: [] for r in reqs}
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] += [(lp.token_id, lp.logprob) for lp in out.new_logprobs]
        pool = engine.kv.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks
        results.append(outs)
    for rid, blocks_out in results[0].items():
        fp32_out = results[1][rid]
        assert [t for t, _ in blocks_out] == [t for t, _ in fp32_out]
        np.testing.assert_allclose([lp for _, lp in blocks_out], [lp for _, lp in fp32_out],
                                   atol=1e-3)


@pytest.mark.slow
def test_smollm_lm_head_blocks_match_fp32(smollm):
    hidden = torch.from_numpy(np.random.default_rng(7).standard_normal((3, 576),
                                                                      dtype=np.float32))
    with_blocks = smollm[0].model.compute_logits(hidden)
    fp32 = smollm[1].model.compute_logits(hidden)
    torch.testing.assert_close(with_blocks, fp32, rtol=0, atol=1e-4)
