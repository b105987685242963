"""Batch invariance on the GPU path (kiln serve's default on CUDA): with kernels/matmul.py's
products, a greedy or seeded request gives the same token ids and the same logprob values
alone, beside others, with its prefix cached, cold, and through the decode graphs. The Triton
path in the interpreter on a tiny random llama (as tests/test_triton_runtime.py), where
torch's CPU GEMMs, like cuBLAS, round a row by its batch."""

import itertools

import pytest
import torch
from conftest import make_request, run_with_logprobs
from test_kernel_count import KernelCount
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
    return [make_request(engine, f"{tag}{i}", p, sp, max_tokens=3, logprobs=2,
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
    pieces, steps = graphs.runner.pieces, []  # the piecewise graphs' steps: their tokens
    forward = pieces.forward
    pieces.forward = lambda ids, *args: steps.append(len(ids)) or forward(ids, *args)
    sampled, sample_rows = [], graphs.runner.graphs.sample_rows  # (top logprobs asked)
    graphs.runner.graphs.sample_rows = lambda *args: sampled.append(1) or sample_rows(*args)
    reqs = _requests(graphs, "g")[1:]
    out = {r.request_id: [] for r in reqs}
    for req in reqs[1:]:  # prefilled through the pieces, decoded in the graphs ...
        graphs.add_request(req)
    for step in itertools.count():
        if step == 2:  # ... then beside this prompt's chunk: a mixed step
            graphs.add_request(reqs[0])
        if not graphs.has_unfinished():
            break
        for o in graphs.step():
            out[o.request_id] += [(lp.token_id, lp.logprob) for lp in o.new_logprobs]
    assert graphs.kv.block_pool.get_num_free_blocks() == graphs.config.num_blocks
    assert steps[:2] == [43, 95], steps
    assert not sampled  # no decode step sampled in the graphs
    in_graphs = {int(rid[1:]): tokens for rid, tokens in out.items()}
    assert all(len(v) == 3 for v in batched.values())
    assert cached == batched and cold == batched
    assert in_graphs == {i: batched[i] for i in in_graphs}


def test_async_steps_through_the_graphs_give_the_synchronous_bits(model):
    """--async-scheduling on the Triton path: each in-flight token is copied (rows in the last
    step's order) or scattered (a row left) from the sampler's output into the graphs' static
    input ids before the replay, and into a penalty window's ring on the device; the replies
    are the synchronous engine's, bit for bit (the products do not follow the batch)."""
    engine, copies, got = _engine(model, graphs=True), [], {}
    fill = engine.runner._tokens_in_flight
    engine.runner._tokens_in_flight = lambda ids, reqs, ends, tokens: copies.append(
        tokens.rows_of(reqs)) or fill(ids, reqs, ends, tokens)
    for overlap in (False, True):
        engine.async_scheduling = overlap
        reqs = [make_request(engine, f"a{i}", p, sp, max_tokens=n, logprobs=2, ignore_eos=True)
                for i, (p, sp, n) in enumerate((
                    ([5, 6, 7], SamplingParams(temperature=0.8, seed=7), 6),
                    (list(range(100, 140)), SamplingParams(temperature=0.0), 3),  # leaves first
                    (list(range(200, 230)), SamplingParams(  # favours repeats: its newest
                        temperature=0.0, repetition_penalty=0.3, repeat_last_n=4), 6)))]  # counts
        got[overlap] = run_with_logprobs(engine, reqs)
        assert engine.kv.block_pool.get_num_free_blocks() == engine.config.num_blocks
    # copied in order (None: the last step's rows), scattered when a1 left: a0 and a2
    assert any(c is None for c in copies) and \
        any(c is not None and c.tolist() == [0, 2] for c in copies), copies
    assert got[True] == got[False]


def test_rows_are_sampled_inside_the_decode_graphs(model):
    """Rows asking for no bias, grammar or top logprobs (greedy, seeded, top_k and top_p,
    the token's own logprob; penalties over a window of up to 64 tokens) take the graphs
    captured with the sampler: a decode step launches no sampler of its own, and every token
    id and logprob is the eager engine's - synchronously, and with --async-scheduling, where
    the in-flight tokens reach the next step's inputs and penalty windows from the graph's
    samples. (Rows with more: the first test, where no replay samples.)"""
    def requests(engine, tag, penalty: bool):
        specs = (([5, 6, 7], SamplingParams(temperature=0.8, seed=7), 5),
                 (list(range(100, 130)), SamplingParams(temperature=0.0), 3),  # leaves first
                 (list(range(200, 220)), SamplingParams(  # favours repeats: its window counts
                     temperature=1.0, top_k=20, top_p=0.9, seed=11,
                     repetition_penalty=0.3 if penalty else 1.0,
                     frequency_penalty=-1.0 if penalty else 0.0, repeat_last_n=4), 5))
        return [make_request(engine, f"{tag}{i}", p, sp, max_tokens=n, logprobs=0,
                             ignore_eos=True) for i, (p, sp, n) in enumerate(specs)]

    eager = _engine(model)
    want = _run(eager, requests(eager, "e", True))
    want_plain = _run(eager, requests(eager, "p", False)[:2])
    engine = _engine(model, graphs=True)
    graphs, replays, eager_samples = engine.runner.graphs, [], []
    sample_rows, run = graphs.sample_rows, engine.sampler.run
    graphs.sample_rows = lambda b, n, columns, window, fill: replays.append(
        (b, window is not None)) or sample_rows(b, n, columns, window, fill)
    engine.sampler.run = lambda *args: eager_samples.append(1) or run(*args)
    for overlap in (False, True):
        engine.async_scheduling = overlap
        replays.clear()
        eager_samples.clear()
        assert _run(engine, requests(engine, "g", True)) == want, overlap
        # buckets of 4 (a padding row) and 2; the prefill's step alone samples eagerly
        assert {b for b, _ in replays} == {4, 2} and {w for _, w in replays} == {True}, \
            replays
        assert len(eager_samples) == 1, eager_samples
    # Without penalties, synchronously: the bits, and what the host launches for a decode
    # step: the inputs' copy and the forward's replay, the sampler's columns' copy and its
    # replay, the samples' packing for their one copy out.
    engine.async_scheduling = False
    replays.clear()
    reqs = requests(engine, "k", False)[:2]
    got = {r.request_id: [] for r in reqs}

    def take(outputs):
        for o in outputs:
            got[o.request_id] += [(lp.token_id, lp.logprob) for lp in o.new_logprobs]
    for req in reqs:
        engine.add_request(req)
    take(engine.step())  # the prefill
    with torch.inference_mode(), KernelCount() as count:
        graphs.replay = count.as_one_launch(graphs.replay, "graph replay")
        graphs._sample = count.as_one_launch(graphs._sample, "graph replay")
        take(engine.step())
    assert dict(count.launches) == {"torch copy_": 2, "graph replay": 2, "torch cat": 1}, \
        count.launches
    while engine.has_unfinished():
        take(engine.step())
    assert {int(rid[1:]): tokens for rid, tokens in got.items()} == want_plain
    assert replays and {w for _, w in replays} == {False}, replays
