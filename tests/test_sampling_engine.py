"""The sampling contract at the engine level, with the real model: seeds, greedy, logprobs
against transformers, and the penalty window carried across a cached conversation."""

import json
from pathlib import Path

import pytest
import torch
from conftest import make_request, run_to_completion

from kiln.runtime.kv.attention_metadata import AttentionMetadata
from kiln.runtime.sampling.params import SamplingParams

GOLDEN = Path(__file__).parent / "golden"


def _prompt(smollm2, text):
    msgs = [{"role": "user", "content": text}]
    return smollm2.tokenizer.encode(smollm2.chat_template.render(msgs), add_special_tokens=False)


def _generate(engine, prompt, sampling, max_tokens=16, logprobs=None, rid="r",
              ignore_eos=False):
    req = make_request(engine, rid, prompt, sampling, max_tokens=max_tokens,
                       logprobs=logprobs, ignore_eos=ignore_eos)
    engine.add_request(req)
    tokens, lps = [], []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                tokens += o.new_token_ids
                lps += o.new_logprobs or []
    return tokens, lps


OPEN = "Invent a name for a pet dragon."
SEEDED = dict(temperature=0.9, top_p=0.95, top_k=0, min_p=0.0, repetition_penalty=1.0)


def test_same_seed_same_tokens_and_an_unseeded_request_between_changes_nothing(
        smollm2, make_engine):
    engine = make_engine(kv_cache_tokens=4096)
    prompt = _prompt(smollm2, OPEN)
    first, _ = _generate(engine, prompt, SamplingParams(**SEEDED, seed=42))
    _generate(engine, prompt, SamplingParams(**SEEDED), rid="unseeded")
    second, _ = _generate(engine, prompt, SamplingParams(**SEEDED, seed=42))
    assert first == second
    other, _ = _generate(engine, prompt, SamplingParams(**SEEDED, seed=43))
    assert other != first


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1, 0])
def test_negative_and_extreme_64_bit_seeds_work(smollm2, make_engine, seed):
    engine = make_engine(kv_cache_tokens=2048)
    prompt = _prompt(smollm2, OPEN)
    a, _ = _generate(engine, prompt, SamplingParams(**SEEDED, seed=seed), max_tokens=8)
    b, _ = _generate(engine, prompt, SamplingParams(**SEEDED, seed=seed), max_tokens=8)
    assert a == b and len(a) > 0


def test_unseeded_requests_draw_from_one_generator_that_carries_on(smollm2, make_engine):
    engine = make_engine(kv_cache_tokens=4096)
    prompt = _prompt(smollm2, OPEN)
    outs = {tuple(_generate(engine, prompt, SamplingParams(**SEEDED), rid=f"u{i}")[0])
            for i in range(3)}
    assert len(outs) > 1


@pytest.mark.parametrize("greedy", [dict(temperature=0.0), dict(temperature=0.7, top_k=1)],
                         ids=["temperature-0", "top_k-1"])
def test_greedy_is_the_same_with_and_without_seed(smollm2, make_engine, greedy):
    engine = make_engine(kv_cache_tokens=2048)
    prompt = _prompt(smollm2, OPEN)
    base = dict(top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    a, _ = _generate(engine, prompt, SamplingParams(**base, **greedy))
    b, _ = _generate(engine, prompt, SamplingParams(**base, **greedy, seed=7))
    c, _ = _generate(engine, prompt, SamplingParams(**base, **greedy, seed=8))
    assert a == b == c


def test_greedy_tokens_and_logprobs_match_transformers(smollm2, make_engine, smollm2_gguf):
    cases = json.loads((GOLDEN / f"{Path(smollm2_gguf).stem}.json").read_text())
    engine = make_engine(kv_cache_tokens=2048)
    for case in cases:
        tokens, lps = _generate(engine, case["prompt_ids"],
                                SamplingParams(temperature=0.0, repetition_penalty=1.0),
                                max_tokens=32, logprobs=5)
        n = len(tokens)  # the model may stop before 32 tokens
        assert tokens == case["greedy_ids"][:n]
        for lp, ref in zip(lps, case["greedy_logprobs"][:n]):
            assert abs(lp.logprob - ref) < 2e-3
            assert lp.top[0][0] == lp.token_id  # greedy takes the most likely token


def _raw_logprobs(smollm2, ids, start):
    """log_softmax of the model's raw logits for each of ids[start:], by one prefill."""
    model, cfg = smollm2.model, smollm2.config
    nb = -(-len(ids) // 16)
    kv = [model.backend.kv_cache(nb, 16, cfg.num_kv_heads, cfg.head_dim)
          for _ in range(cfg.num_layers)]
    T = len(ids)
    meta = AttentionMetadata(torch.tensor([0, T], dtype=torch.int32),
                             torch.tensor([T], dtype=torch.int32),
                             torch.arange(nb, dtype=torch.int32)[None], torch.arange(T), T, T)
    with torch.inference_mode():
        h = model.forward(torch.tensor(ids), torch.arange(T), meta, kv)
        logits = model.compute_logits(h[start - 1:T - 1])
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[start:])[:, None])[:, 0]


def test_logprobs_are_raw_and_do_not_move_with_penalties(smollm2, make_engine):
    engine = make_engine(kv_cache_tokens=2048)
    prompt = _prompt(smollm2, "Repeat the word apple ten times.")
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.5,
                               frequency_penalty=1.0, repeat_last_n=-1)
    tokens, lps = _generate(engine, prompt, penalised, max_tokens=20, logprobs=3,
                            ignore_eos=True)
    raw = _raw_logprobs(smollm2, prompt + tokens, len(prompt))
    got = torch.tensor([lp.logprob for lp in lps])
    assert torch.allclose(got, raw, atol=2e-3), (got - raw).abs().max()
    plain, _ = _generate(engine, prompt, SamplingParams(temperature=0.0, repetition_penalty=1.0),
                         max_tokens=20, ignore_eos=True)
    assert plain != tokens  # the penalties did change the choice, not the logprobs


def test_a_cached_conversation_carries_its_reply_tail_into_the_window(smollm2, make_engine):
    engine = make_engine(kv_cache_tokens=4096)
    sp = SamplingParams(temperature=0.0, presence_penalty=0.5, repeat_last_n=8)
    prompt = _prompt(smollm2, OPEN)
    first = make_request(engine, "a", prompt, sp, max_tokens=12, ignore_eos=True)
    run_to_completion(engine, [first])
    follow_up = first.all_token_ids + _prompt(smollm2, "Another one.")
    carried = make_request(engine, "b", follow_up, sp, max_tokens=1)
    run_to_completion(engine, [carried])
    assert carried.window_prefix == first.output_token_ids
    # With a seed the window starts empty; a prompt that is no continuation carries nothing.
    seeded = make_request(engine, "c", follow_up, SamplingParams(
 temperature=0.0, presence_penalty=0.5, repeat_last_n=8, seed=1), max_tokens=1)
    fresh = make_request(engine, "d", _prompt(smollm2, "Unrelated."), sp, max_tokens=1)
    run_to_completion(engine, [seeded, fresh])
    assert seeded.window_prefix == [] and fresh.window_prefix == []
