"""Batch invariance on the GPU path (kiln serve's default on CUDA): with kernels/matmul.py's
products, a greedy or seeded request gives the same token ids and the same logprob values
alone, beside others, with its prefix cached, cold, and through the decode graphs. The Triton
path in the interpreter on a tiny random llama (as tests/test_triton_runtime.py), where
torch's CPU GEMMs, like cuBLAS, round a row by its batch."""

import pytest
from conftest import make_request, run_with_logprobs
from tiny_gguf import llama_metadata, llama_tensors, write_gguf

from kiln.runtime.backends.dense import DenseBackend
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.llm_engine import LLMEngine
from kiln.runtime.models.loader import load_model
from kiln.runtime.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def model(smollm2, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    write_gguf(path, "llama", llama_metadata(), llama_tensors(smollm2.config.vocab_size),
               tokenizer_from=smollm2.path)
    return load_model(str(path), backend=DenseBackend("cpu", use_triton=True,
                                                       batch_invariant=True))


def _engine(model, graphs=False):
    return LLMEngine(model, EngineConfig.build(4096, 512, kv_cache_tokens=4096, max_num_seqs=8,
                                               use_triton=True, cuda_graphs=graphs))


def _requests(engine, tag):
    long_prompt = [(i * 37) % 5000 + 10 for i in range(100)]
    specs = [
        (long_prompt, SamplingParams(temperature=0.0)),
        (long_prompt[:90] + [11, 12, 13], SamplingParams(temperature=0.0)),
        ([5, 6, 7], SamplingParams(temperature=0.8, seed=7)),
        (list(range(100, 140)), SamplingParams(temperature=1.0, top_k=20, top_p=0.9,
                                               repetition_penalty=1.3, seed=3)),
    ]
    return [make_request(engine, f"{tag}{i}", p, sp, max_tokens=5, logprobs=2,
                         ignore_eos=True) for i, (p, sp) in enumerate(specs)]


def _run(engine, requests) -> dict[int, list[tuple[int, float]]]:
    """{request's index: [(token id, its logprob), ...]}"""
    out = run_with_logprobs(engine, requests)
    assert engine.kv.block_pool.get_num_free_blocks() == engine.config.num_blocks
    return {int(rid[1:]): tokens for rid, tokens in out.items()}


def test_a_request_has_the_same_bits_alone_batched_cached_cold_and_in_graphs(model):
    engine = _engine(model)
    batched = _run(engine, _requests(engine, "b"))  # all four at once, cold
    cached, reqs = {}, _requests(engine, "c")
    for req in reqs:  # one at a time, the prompts now cached
        cached |= _run(engine, [req])
    assert reqs[1].num_cached_tokens == 80  # the first request's blocks
    cold = {}
    for req in _requests(fresh := _engine(model), "s")[::-1]:  # alone, cold, in reverse
        cold |= _run(fresh, [req])
        assert req.num_cached_tokens == 0 and fresh.reset_prefix_cache()
    graphs = _engine(model, graphs=True)
    in_graphs = _run(graphs, _requests(graphs, "g")[1:])  # decode as a bucket of 4 rows
    assert all(len(v) == 5 for v in batched.values())
    assert cached == batched and cold == batched
    assert in_graphs == {i: batched[i] for i in in_graphs}
