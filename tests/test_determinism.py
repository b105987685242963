"""Reproducible to the bit, by default: the same seeded or greedy request gives the same token
ids and the same logprob values (==) alone, beside 15 other requests, with its prompt prefix
from the cache, and cold after a cache reset (the engine as `kiln serve` builds it on a CPU,
with no flag)."""

import pytest
from conftest import make_request, run_to_completion

from kiln.runtime.sampling.params import SamplingParams

SEEDED = SamplingParams(temperature=0.8, top_p=0.95, top_k=40, min_p=0.0,
                        repetition_penalty=1.1, presence_penalty=0.3, seed=1234)
GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0)


def _prompt(smollm2, text):
    msgs = [{"role": "system", "content": "You are a storyteller. " * 12},
            {"role": "user", "content": text}]
    return smollm2.tokenizer.encode(smollm2.chat_template.render(msgs), add_special_tokens=False)


def _run(engine, prompt, sampling, max_tokens, others=()):
    target = make_request(engine, "target", prompt, sampling, max_tokens=max_tokens,
                          logprobs=5)
    reqs = [target] + list(others)
    outs = {r.request_id: [] for r in reqs}
    lps = []
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
            if o.request_id == "target":
                lps += [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in o.new_logprobs]
    return outs["target"], lps, target.num_cached_tokens


def _others(engine, smollm2, n=15):
    texts = ["Tell me about " + "rivers " * (i % 5 + 1) for i in range(n)]
    return [make_request(engine, f"o{i}", _prompt(smollm2, t)[: 40 + 9 * i],
                         SamplingParams(temperature=0.7, seed=i), max_tokens=5 + 3 * i)
            for i, t in enumerate(texts)]


@pytest.mark.parametrize("sampling,max_tokens", [(SEEDED, 32), (GREEDY, 200)],
                         ids=["seeded-0.8", "greedy-200"])
def test_same_bits_alone_batched_cached_and_cold(smollm2, make_engine, sampling, max_tokens):
    prompt = _prompt(smollm2, "Invent a name for a pet dragon and tell its story.")
    engine = make_engine(kv_cache_tokens=8192)
    alone = _run(engine, prompt, sampling, max_tokens)
    assert engine.reset_prefix_cache()
    batched = _run(engine, prompt, sampling, max_tokens, _others(engine, smollm2))
    assert engine.reset_prefix_cache()
    # Cache the prompt's prefix with another request first.
    run_to_completion(engine, [make_request(engine, "warm", prompt, GREEDY, max_tokens=1)])
    cached = _run(engine, prompt, sampling, max_tokens)
    assert cached[2] > 0 and alone[2] == 0
    assert engine.reset_prefix_cache()
    cold = _run(engine, prompt, sampling, max_tokens)
    assert cold[2] == 0
    assert len(alone[0]) > 0
    assert batched[:2] == alone[:2]
    assert cached[:2] == alone[:2]
    assert cold[:2] == alone[:2]


@pytest.fixture(scope="module")
def smollm2_int8(smollm2_gguf):
    from kiln.runtime.backends.cpu.backend import CpuBackend
    from kiln.runtime.models.loader import load_model

    return load_model("smollm2:135m", backend=CpuBackend(int8_products=True))


def test_int8_activations_keep_the_bits_alone_batched_and_cached(smollm2, smollm2_int8,
                                                                  make_engine):
    """--int8-activations changes the logits (within rounding x to 8 bits), not their
    reproducibility: 8-bit x is rounded per row, and integer sums are exact."""
    prompt = _prompt(smollm2, "Invent a name for a pet dragon and tell its story.")
    engine = make_engine(kv_cache_tokens=8192, model=smollm2_int8)
    alone = _run(engine, prompt, SEEDED, 32)
    assert engine.reset_prefix_cache()
    batched = _run(engine, prompt, SEEDED, 32, _others(engine, smollm2))
    run_to_completion(engine, [make_request(engine, "warm", prompt, GREEDY, max_tokens=1)])
    cached = _run(engine, prompt, SEEDED, 32)
    assert cached[2] > 0
    assert alone[:2] == batched[:2] == cached[:2]
    fp32 = _run(make_engine(kv_cache_tokens=8192), prompt, SEEDED, 32)
    assert fp32[1] != alone[1]  # the logprobs are the 8-bit path's own


def test_reused_outputs_change_no_bit(smollm2, make_engine):
    """make_backend's CPU backend writes each layer operation's decode-step output into a
    buffer of its own, and a larger step's into one that the operations of its kind and width
    share (backends/cpu/outputs.py); a backend that allocates every output gives the same
    replies, batched (steps of 5 rows, and prefill chunks of more than 16), bit for bit."""
    from kiln.runtime.backends.cpu.backend import CpuBackend
    from kiln.runtime.models.loader import load_model

    assert smollm2.model.backend.reuse_outputs
    fresh = load_model("smollm2:135m", backend=CpuBackend())
    assert not fresh.model.backend.reuse_outputs
    prompt = _prompt(smollm2, "Invent a name for a pet dragon and tell its story.")
    results = []
    for model in (smollm2, fresh):
        engine = make_engine(kv_cache_tokens=8192, model=model)
        results.append(_run(engine, prompt, SEEDED, 24, _others(engine, smollm2)))
    assert len(results[0][0]) == 24 and results[0][:2] == results[1][:2]
