"""`--dtype bfloat16` on the CPU (runtime/backends/cpu/bf16.py): the packed product against
fp32 arithmetic on the same bf16 values, the model against transformers (fp32, tests/golden/)
within bf16's rounding, and where kiln refuses it."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_request
from paged import PagedSequence

from kiln.runtime.backends import dtype_refusal, resolve_dtype
from kiln.runtime.backends.cpu.bf16 import PackedBf16, bf16_supported
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.llm_engine import LLMEngine
from kiln.runtime.models.loader import load_model
from kiln.runtime.sampling.params import SamplingParams
from kiln.runtime.store.gguf_file import WeightSource

GOLDEN = Path(__file__).parent / "golden"
# bf16 rounding moves a logit by at most about 0.26 here (measured on the golden prompts): a
# token within twice the bound below below the best one is a near-tie, which either may win.
MAX_LOGIT_ERROR = 0.6
needs_bf16 = pytest.mark.skipif(not bf16_supported(), reason="no native bf16 on this CPU")


@pytest.fixture(scope="module")
def bf16_model(smollm2_gguf):
    return load_model("smollm2:135m", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def golden(smollm2_gguf):
    stem = Path(smollm2_gguf).stem
    return (json.loads((GOLDEN / f"{stem}.json").read_text()),
            np.load(GOLDEN / f"{stem}.npz"))


@needs_bf16
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_product_is_fp32_arithmetic_on_bf16_values(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(160, 96, generator=g)  # [out, in]
    exact = x.bfloat16().double() @ w.bfloat16().double().T
    from gguf import GGMLQuantizationType

    got = PackedBf16([WeightSource("w", GGMLQuantizationType.F32, 160, 96, w.numpy())], None)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 160)
    # fp32 accumulation, then the output rounded to bf16 (8 bits of mantissa)
    torch.testing.assert_close(got.double(), exact, rtol=2 ** -8, atol=1e-3)


@needs_bf16
@pytest.mark.parametrize("case", [0, 1, 2])
def test_bf16_logits_stay_within_rounding_of_transformers(bf16_model, golden, case):
    cases, arrays = golden
    ref = torch.from_numpy(arrays[f"logits_{case}"])
    logits = PagedSequence(bf16_model.model).feed(cases[case]["prompt_ids"])
    # measured on the development Xeon: max abs diff 0.22-0.26, KL 6e-4 to 1e-3
    assert (logits - ref).abs().max().item() < MAX_LOGIT_ERROR
    ref_logp, logp = torch.log_softmax(ref, -1), torch.log_softmax(logits, -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum().item()
    assert kl < 5e-3, f"KL {kl}"
    # bf16's best token is transformers' best, or ties with it within the rounding
    assert ref[logits.argmax()] >= ref.max() - 2 * MAX_LOGIT_ERROR


@needs_bf16
def test_bf16_engine_decodes_greedily_within_rounding_of_fp32(bf16_model, smollm2, golden):
    """Each token the bf16 engine picks greedily is fp32's best along the same path, or
    within bf16's rounding of it (the fp32 kernels match transformers: test_model_parity)."""
    cases, _ = golden
    config = EngineConfig.build(bf16_model.ctx_len, bf16_model.max_prefill_len,
                                kv_cache_tokens=2048)
    engine = LLMEngine(bf16_model, config)
    reqs = [make_request(engine, f"g{i}", cases[i]["prompt_ids"],
                         SamplingParams(temperature=0.0), max_tokens=12,
                         ignore_eos=True) for i in range(3)]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    pool = engine.kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    for r in reqs:
        assert r.num_output_tokens == 12
        fp32 = PagedSequence(smollm2.model).feed(r.all_token_ids[:-1], every_position=True)
        steps = fp32[r.num_prompt_tokens - 1:]  # the logits each output token was chosen from
        for logits, token in zip(steps, r.output_token_ids, strict=True):
            assert logits[token] >= logits.max() - 2 * MAX_LOGIT_ERROR


def test_refusals():
    assert dtype_refusal("float32", cuda=False) is None
    assert dtype_refusal("auto", cuda=False) is None
    assert "CUDA only" in dtype_refusal("float16", cuda=False)
    assert (dtype_refusal("bfloat16", cuda=False) is None) == bf16_supported()
    assert resolve_dtype("auto", cuda=False) == "float32"


def test_loading_a_model_leaves_the_serving_thread_count_alone():
    """A model switch builds the new backend while the old engine still steps: torch's
    process-wide thread count is the stepping runner's to set, on its first step."""
    import torch

    from kiln.runtime.backends.cpu.backend import CpuBackend

    before = torch.get_num_threads()
    backend = CpuBackend(bf16_products=True, threads=before + 3)
    assert torch.get_num_threads() == before
    assert backend.torch_threads == before + 3
