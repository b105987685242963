"""The runtime's Triton path end to end: a tiny random llama served by an LLMEngine whose
attention, KV store and sampler are the Triton kernels (in the interpreter on CPU), against
the same engine on the CPU path. It checks the wiring the kernel tests cannot: block tables
and slot mappings built by the runner, prefill chunks after a prefix-cache hit, batched
decode, the sampler's metadata and the grammar bitmask."""

import json

import pytest
import torch
from conftest import make_request, run_to_completion, run_with_logprobs
from tiny_gguf import llama_metadata, llama_tensors, write_gguf

from kiln.runtime.backends.cpu.backend import CpuBackend
from kiln.runtime.backends.dense import DenseBackend
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.llm_engine import LLMEngine
from kiln.runtime.models.loader import load_model
from kiln.runtime.sampling.grammar import GrammarSpec
from kiln.runtime.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def engines(smollm2, tmp_path_factory):
    """(Triton engine, CPU engine) on the same tiny GGUF (head size 64, the smallest the
    attention kernel takes; two query heads per KV head), with smollm2's tokenizer."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    write_gguf(path, "llama", llama_metadata(), llama_tensors(smollm2.config.vocab_size),
               tokenizer_from=smollm2.path)
    built = []
    for backend in (DenseBackend("cpu", use_triton=True), CpuBackend()):
        loaded = load_model(str(path), backend=backend)
        # 512-token chunks: the 700-token prompt is prefilled in two.
        config = EngineConfig.build(4096, 512, kv_cache_tokens=4096, max_num_seqs=8,
                                    use_triton=backend.name == "dense")
        built.append(LLMEngine(loaded, config))
    return built


@pytest.fixture(scope="module")
def graph_engine(engines):
    """The Triton engine's model with decode steps through DecodeGraphs: batches padded to
    the buckets (1, 2, 4, 8), contexts within one partition or split over the whole context;
    replayed eagerly off CUDA."""
    loaded = engines[0].loaded
    config = EngineConfig.build(4096, 512, kv_cache_tokens=4096, max_num_seqs=8,
                                use_triton=True, cuda_graphs=True)
    return LLMEngine(loaded, config)


def _requests(engine, tag):
    long_prompt = [(i * 37) % 5000 + 10 for i in range(700)]
    specs = [
        (long_prompt, SamplingParams(temperature=0.0)),
        (long_prompt[:600] + [11, 12, 13], SamplingParams(temperature=0.0)),  # cache hit
        ([5, 6, 7], SamplingParams(temperature=0.8, seed=7)),
        (list(range(100, 140)), SamplingParams(temperature=1.0, top_k=20, top_p=0.9,
                                               repetition_penalty=1.3, seed=-3)),
    ]
    return [make_request(engine, f"{tag}{i}", p, sp, max_tokens=6, logprobs=2,
                         ignore_eos=True) for i, (p, sp) in enumerate(specs)]


def test_the_triton_engine_generates_what_the_cpu_engine_does(engines):
    triton_engine, cpu_engine = engines
    # The first request runs alone, so the second finds its prefix in the cache.
    got, want = {}, {}
    for engine, out in ((triton_engine, got), (cpu_engine, want)):
        reqs = _requests(engine, "r")
        out |= run_with_logprobs(engine, reqs[:1])
        out |= run_with_logprobs(engine, reqs[1:])
        assert reqs[1].num_cached_tokens >= 592
        assert engine.kv.block_pool.get_num_free_blocks() == engine.config.num_blocks
    assert {k: [t for t, _ in v] for k, v in got.items()} == \
        {k: [t for t, _ in v] for k, v in want.items()}
    for rid in want:
        assert len(got[rid]) == 6
        torch.testing.assert_close(torch.tensor([lp for _, lp in got[rid]]),
                                   torch.tensor([lp for _, lp in want[rid]]),
                                   atol=1e-4, rtol=0)


def test_decode_through_the_graph_buckets_generates_what_the_eager_engine_does(
        engines, graph_engine):
    """Three requests decode as a bucket of 4 (one padding row), then 2 as a bucket of 2;
    with the 603-token request in the batch through the capture split over the whole
    context, without it through the one-partition capture (attention in one kernel)."""
    graphs, buckets, spans = graph_engine.runner.graphs, [], []
    replay, span = graphs.replay, graphs.span
    graphs.replay = lambda *args: buckets.append(args[0]) or replay(*args)
    graphs.span = lambda n: spans.append(span(n)) or spans[-1]
    got, want = {}, {}
    for engine, out in ((graph_engine, got), (engines[0], want)):
        reqs = _requests(engine, "g")[1:]
        reqs[0].max_tokens = 3  # leaves the batch early: the bucket shrinks
        out |= run_with_logprobs(engine, reqs)
        assert engine.kv.block_pool.get_num_free_blocks() == engine.config.num_blocks
    assert {4, 2} <= set(buckets), buckets
    assert graphs.spans == [512, 4096] and set(spans) == {512, 4096}, spans
    assert {k: [t for t, _ in v] for k, v in got.items()} == \
        {k: [t for t, _ in v] for k, v in want.items()}
    # Not bit for bit: torch's CPU GEMMs round a batch of 4 (the bucket) and one of 3
    # differently, and the graphs split the KV over the whole context.
    for rid in want:
        torch.testing.assert_close(torch.tensor([lp for _, lp in got[rid]]),
                                   torch.tensor([lp for _, lp in want[rid]]),
                                   atol=3e-5, rtol=0)


def test_the_triton_sampler_follows_the_grammar_bitmask(engines, smollm2):
    outputs = []
    for engine in engines:
        req = make_request(engine, "g", [1, 2, 3], SamplingParams(temperature=1.0, seed=1),
                           max_tokens=12, grammar=GrammarSpec("json_object"))
        outputs.append(run_to_completion(engine, [req])["g"])
    assert outputs[0] == outputs[1]
    text = smollm2.tokenizer.decode(outputs[0])
    assert text.lstrip().startswith("{"), text
    if outputs[0][-1] in smollm2.tokenizer.stop_token_ids:  # finished: the whole object parses
        json.loads(smollm2.tokenizer.decode(outputs[0][:-1]))


def test_bias_min_tokens_prompt_logprobs_and_choices_match_the_cpu_engine(engines):
    """The per-request extras through the Triton path: logit_bias and min_tokens (the bias
    columns of the sampler's metadata), prompt logprobs, and a second choice that waits for
    the first one's prefill and reads its blocks from the cache."""
    results = []
    for engine in engines:
        prompt = [(i * 53) % 4000 + 7 for i in range(40)]
        eos = sorted(engine.loaded.tokenizer.stop_token_ids)
        bias = tuple(sorted({17: 5.0, 300: -3.0, 4001: 2.5}.items()))
        leader = make_request(engine, "a", prompt, SamplingParams(temperature=0.9, seed=5),
                              max_tokens=4, logprobs=1, logit_bias=bias,
                              min_tokens=4, prompt_logprobs=2,
                              stop_token_ids=frozenset(eos))
        sibling = make_request(engine, "b", prompt, SamplingParams(temperature=0.0),
                               max_tokens=3, logprobs=1, prefill_leader="a",
                               logit_bias=((eos[0], float("-inf")),))
        for r in (leader, sibling):
            engine.add_request(r)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        first = next(o for o in outs if o.request_id == "a")
        results.append((
            [(o.request_id, o.new_token_ids) for o in outs],
            [e and (e.token_id, e.logprob, e.top) for e in first.prompt_logprobs],
            sibling.num_cached_tokens))
        assert engine.kv.block_pool.get_num_free_blocks() == engine.config.num_blocks
    (got_tokens, got_prompt, got_cached), (want_tokens, want_prompt, want_cached) = results
    assert got_tokens == want_tokens and got_cached == want_cached == 32
    assert [e and e[0] for e in got_prompt] == [e and e[0] for e in want_prompt]
    torch.testing.assert_close(torch.tensor([e[1] for e in got_prompt[1:]]),
                               torch.tensor([e[1] for e in want_prompt[1:]]), atol=1e-4, rtol=0)
    assert [[t for t, _ in e[2]] for e in got_prompt[1:]] == \
        [[t for t, _ in e[2]] for e in want_prompt[1:]]


class ReplayDrafter:
    """Drafts two tokens of a known reply, then a wrong one: every step keeps two drafts and
    rejects the third, through the Triton attention's rows of several query tokens."""

    def __init__(self, prompt_len: int, reply: list[int]):
        self.prompt_len, self.reply = prompt_len, reply

    def propose(self, requests, lengths):
        drafts = []
        for req, k in zip(requests, lengths):
            done = req.num_tokens - self.prompt_len
            ahead = self.reply[done:done + min(k, 2)]
            drafts.append((ahead + [(self.reply[done + len(ahead)] + 1) % 4096])[:k]
                          if done + len(ahead) < len(self.reply) else ahead)
        return drafts


def test_drafted_rows_through_the_triton_path_keep_the_greedy_reply(engines):
    from kiln.runtime.drafting.config import SpeculativeConfig

    prompt = [(i * 31) % 3000 + 20 for i in range(40)]
    plain = engines[1]
    want = run_to_completion(plain, [make_request(plain, "w", prompt, SamplingParams(
        temperature=0.0), max_tokens=12, ignore_eos=True)])["w"]
    for engine in engines:
        config = EngineConfig.build(4096, 512, kv_cache_tokens=4096, max_num_seqs=8,
                                    use_triton=engine.config.use_triton,
                                    speculative=SpeculativeConfig(num_speculative_tokens=3))
        drafting = LLMEngine(engine.loaded, config)
        drafting.drafter = ReplayDrafter(len(prompt), want)
        req = make_request(drafting, "d", prompt, SamplingParams(temperature=0.0),
                           max_tokens=12, ignore_eos=True)
        assert run_to_completion(drafting, [req])["d"] == want
        assert req.num_accepted_tokens >= 6 and req.num_drafted_tokens > req.num_accepted_tokens
        assert drafting.kv.block_pool.get_num_free_blocks() == config.num_blocks


class ReplayDrafters:
    """ReplayDrafter for several requests at once, by request id."""

    def __init__(self, drafters: dict[str, ReplayDrafter]):
        self.drafters = drafters

    def propose(self, requests, lengths):
        return [self.drafters[r.request_id].propose([r], [k])[0]
                for r, k in zip(requests, lengths)]


def test_drafted_rows_decode_through_graph_buckets_of_their_own(engines):
    """Three requests drafting two right tokens and a wrong one each step: their rows (1 to 4
    tokens) pad to the drafts' bucket of 4 rows (17 tokens, the spare ones in padding
    sequences that store nothing), and each reply is the greedy one."""
    from kiln.runtime.drafting.config import SpeculativeConfig

    plain = engines[1]
    prompts = {f"d{i}": [(i * 131 + j * 31) % 3000 + 20 for j in range(40 + 9 * i)]
               for i in range(3)}
    want = run_to_completion(plain, [
        make_request(plain, rid, p, SamplingParams(temperature=0.0), max_tokens=12,
                     ignore_eos=True) for rid, p in prompts.items()])
    config = EngineConfig.build(4096, 512, kv_cache_tokens=4096, max_num_seqs=8,
                                use_triton=True, cuda_graphs=True,
                                speculative=SpeculativeConfig(num_speculative_tokens=3))
    engine = LLMEngine(engines[0].loaded, config)
    engine.drafter = ReplayDrafters({rid: ReplayDrafter(len(p), want[rid])
                                     for rid, p in prompts.items()})
    graphs, shapes = engine.runner.spec_graphs, []
    stage = graphs.stage  # (bucket, the padded step's tokens)
    graphs.stage = lambda b, ids, *args: shapes.append((b, len(ids))) or stage(b, ids, *args)
    reqs = [make_request(engine, rid, p, SamplingParams(temperature=0.0), max_tokens=12,
                         ignore_eos=True) for rid, p in prompts.items()]
    assert run_to_completion(engine, reqs) == want
    assert (4, 17) in shapes, shapes
    assert all(r.num_accepted_tokens >= 4 for r in reqs)
    assert engine.kv.block_pool.get_num_free_blocks() == config.num_blocks
