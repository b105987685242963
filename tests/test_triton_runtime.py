"""The runtime's Triton path end to end: a tiny random llama served by an LLMEngine whose
attention, KV store and sampler are the Triton kernels (in the interpreter on CPU), against
the same engine on the CPU path. It checks the wiring the kernel tests cannot: block tables
and slot mappings built by the runner, prefill chunks after a prefix-cache hit, batched
decode, the sampler's metadata and the grammar bitmask."""

import json

import pytest
import torch
from conftest import run_to_completion

from runtime.config import EngineConfig, ModelConfig
from runtime.engine import LLMEngine
from runtime.grammar import GrammarSpec
from runtime.model_loader import LoadedModel
from runtime.models.llama import LlamaModel
from runtime.sampling_params import SamplingParams

# Head size 64 is the smallest the attention kernel takes; two query heads per KV head.
TINY = dict(arch="llama", num_layers=2, hidden_size=128, intermediate_size=256, num_heads=2,
            num_kv_heads=1, head_dim=64, max_position=4096, rope_theta=10000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=True)


def _tensors(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    # Attention weights large enough that a K/V row in the wrong slot changes the logits.
    h, inter, q, kv = 128, 256, 128, 64
    t = {"token_embd.weight": rand(vocab, h, scale=0.3), "output_norm.weight": 1 + rand(h)}
    for i in range(2):
        p = f"blk.{i}."
        t |= {p + "attn_norm.weight": 1 + rand(h), p + "ffn_norm.weight": 1 + rand(h),
              p + "attn_q.weight": rand(q, h, scale=0.3),
              p + "attn_k.weight": rand(kv, h, scale=0.3),
              p + "attn_v.weight": rand(kv, h, scale=0.5), p + "attn_output.weight": rand(h, q),
              p + "ffn_gate.weight": rand(inter, h), p + "ffn_up.weight": rand(inter, h),
              p + "ffn_down.weight": rand(h, inter)}
    return t


@pytest.fixture(scope="module")
def engines(smollm2):
    """(Triton engine, CPU engine) on the same tiny weights, with smollm2's tokenizer."""
    vocab = smollm2.config.vocab_size
    cfg = ModelConfig(vocab_size=vocab, **TINY)
    tensors = _tensors(vocab)
    built = []
    for use_triton in (True, False):
        model = LlamaModel(cfg, tensors, "cpu", torch.float32, use_triton=use_triton)
        loaded = LoadedModel("tiny", smollm2.path, None, cfg, model, smollm2.tokenizer,
                             smollm2.chat_template, 0.0)
        # 512-token chunks: the 700-token prompt is prefilled in two.
        config = EngineConfig.build(4096, 512, kv_cache_tokens=4096, max_num_seqs=8,
                                    use_triton=use_triton)
        built.append(LLMEngine(loaded, config))
    return built


def _requests(engine, tag):
    long_prompt = [(i * 37) % 5000 + 10 for i in range(700)]
    specs = [
        (long_prompt, SamplingParams(temperature=0.0)),
        (long_prompt[:600] + [11, 12, 13], SamplingParams(temperature=0.0)),  # cache hit
        ([5, 6, 7], SamplingParams(temperature=0.8, seed=7)),
        (list(range(100, 140)), SamplingParams(temperature=1.0, top_k=20, top_p=0.9,
                                               repetition_penalty=1.3, seed=-3)),
    ]
    return [engine.make_request(f"{tag}{i}", p, sp, max_tokens=6, num_top_logprobs=2,
                                ignore_eos=True) for i, (p, sp) in enumerate(specs)]


def _run(engine, requests) -> dict[str, list[tuple[int, float]]]:
    """Step until the requests finish: {request_id: [(token id, its logprob), ...]}."""
    for r in requests:
        engine.add_request(r)
    out = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += [(lp.token_id, lp.logprob) for lp in o.new_logprobs]
    return out


def test_the_triton_engine_generates_what_the_cpu_engine_does(engines):
    triton_engine, cpu_engine = engines
    # The first request runs alone, so the second finds its prefix in the cache.
    got, want = {}, {}
    for engine, out in ((triton_engine, got), (cpu_engine, want)):
        reqs = _requests(engine, "r")
        out |= _run(engine, reqs[:1])
        out |= _run(engine, reqs[1:])
        assert reqs[1].num_cached_tokens >= 592
        assert engine.kv.block_pool.get_num_free_blocks() == engine.config.num_blocks
    assert {k: [t for t, _ in v] for k, v in got.items()} == \
        {k: [t for t, _ in v] for k, v in want.items()}
    for rid in want:
        assert len(got[rid]) == 6
        torch.testing.assert_close(torch.tensor([lp for _, lp in got[rid]]),
                                   torch.tensor([lp for _, lp in want[rid]]),
                                   atol=1e-4, rtol=0)


def test_the_triton_sampler_follows_the_grammar_bitmask(engines, smollm2):
    outputs = []
    for engine in engines:
        compiled = engine.grammars.get(GrammarSpec("json_object"))
        req = engine.make_request("g", [1, 2, 3], SamplingParams(temperature=1.0, seed=1),
                                  max_tokens=12, grammar=compiled)
        outputs.append(run_to_completion(engine, [req])["g"])
    assert outputs[0] == outputs[1]
    text = smollm2.tokenizer.decode(outputs[0])
    assert text.lstrip().startswith("{"), text
    if outputs[0][-1] in smollm2.tokenizer.stop_token_ids:  # finished: the whole object parses
        json.loads(smollm2.tokenizer.decode(outputs[0][:-1]))
