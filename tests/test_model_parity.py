"""kiln's llama forward against transformers' model loaded from the same GGUF (fp32), on each
backend: the CPU kernels (as built for this machine, and as an AVX2 build where this machine
has AVX-512, which must give the same bits) and torch on dense weights.

The transformers outputs are stored in tests/golden/ by tests/make_golden.py.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from paged import PagedSequence

from kiln.runtime.backends.cpu import library
from kiln.runtime.backends.cpu.backend import CpuBackend
from kiln.runtime.backends.dense import DenseBackend
from kiln.runtime.models import llama
from kiln.runtime.store.gguf_file import open_gguf

GOLDEN = Path(__file__).parent / "golden"
LOGITS_ATOL = 1e-3  # measured: about 5e-5 to 1e-4 on all three prompts


def _has_avx512() -> bool:
    return "avx512f" in library._cpu_flags().split()


@pytest.fixture(scope="module")
def gf(smollm2_gguf):
    return open_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def golden(smollm2_gguf):
    stem = Path(smollm2_gguf).stem
    return (json.loads((GOLDEN / f"{stem}.json").read_text()),
            np.load(GOLDEN / f"{stem}.npz"))


BACKENDS = {
    "cpu-kernels": lambda: CpuBackend(),
    "cpu-kernels-avx2": lambda: CpuBackend(extra_flags=("-mno-avx512f",)),
    "dense-torch": lambda: DenseBackend("cpu"),
}


@pytest.fixture(scope="module", params=list(BACKENDS))
def model(request, gf):
    if request.param == "cpu-kernels-avx2" and not _has_avx512():
        pytest.skip("this CPU has no AVX-512: the default build is the AVX2 one")
    return llama.build(llama.read_config(gf), gf, BACKENDS[request.param]())


@pytest.mark.parametrize("case", [0, 1, 2])
def test_last_position_logits_match_transformers(model, golden, case):
    cases, arrays = golden
    ref = torch.from_numpy(arrays[f"logits_{case}"])
    logits = PagedSequence(model).feed(cases[case]["prompt_ids"])
    diff = (logits - ref).abs().max().item()
    assert diff < LOGITS_ATOL, f"max abs diff {diff}"
    assert logits.topk(10).indices.tolist() == ref.topk(10).indices.tolist()


@pytest.mark.skipif(not _has_avx512(), reason="needs AVX-512 to compare with the AVX2 build")
def test_avx2_and_avx512_builds_give_the_same_bits(gf, golden):
    cases, _ = golden
    cfg = llama.read_config(gf)
    out = []
    for flags in ((), ("-mno-avx512f",)):
        model = llama.build(cfg, gf, CpuBackend(extra_flags=flags))
        seq = PagedSequence(model)
        logits = [seq.feed(cases[2]["prompt_ids"])]
        logits += [seq.feed([int(logits[-1].argmax())]) for _ in range(3)]
        out.append(torch.stack(logits))
    assert torch.equal(out[0], out[1])
