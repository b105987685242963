"""The engine's per-request extras with the real model: n choices that share one prefill,
prompt logprobs (against transformers' logprobs stored in tests/golden/), min_tokens,
ignore_eos and logit_bias."""

import json
from pathlib import Path

import pytest
from conftest import make_request, run_to_completion

from kiln.runtime.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0)
GOLDEN = Path(__file__).parent / "golden"
LOGPROB_ATOL = 2e-3  # the golden logits agree to ~1e-4 (test_model_parity); softmax adds little


@pytest.fixture(scope="module")
def golden(smollm2_gguf):
    return json.loads((GOLDEN / f"{Path(smollm2_gguf).stem}.json").read_text())


def _drain(engine) -> list:
    """Step until every request has finished; every output, in order."""
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def _pool_is_clean(engine) -> bool:
    pool = engine.kv.block_pool
    return pool.get_num_free_blocks() == pool.num_blocks and not engine.kv.req_to_blocks


def test_choices_after_the_first_read_the_prompt_from_its_prefill(make_engine):
    engine = make_engine(kv_cache_tokens=4096)
    prompt = list(range(1000, 1148))  # 148 tokens: 9 full blocks; an open continuation
    sampling = SamplingParams(temperature=0.9, seed=11)
    leader = make_request(engine, "c0", prompt, sampling, max_tokens=6, ignore_eos=True)
    siblings = [make_request(engine, f"c{i}", prompt, SamplingParams(temperature=0.9, seed=11 + i),
                             max_tokens=6, ignore_eos=True, prefill_leader="c0")
                for i in (1, 2)]
    for r in [leader, *siblings]:
        engine.add_request(r)
    first = engine.step()  # the leader's whole prefill; the siblings wait for it
    assert [o.request_id for o in first] == ["c0"]
    _drain(engine)
    assert leader.num_cached_tokens == 0
    assert [s.num_cached_tokens for s in siblings] == [144, 144]  # every full block
    assert engine.stats().prefix_hit_tokens == 288
    # Each choice draws from its own seed: the same tokens as that request alone.
    for s in siblings:
        alone = make_engine(kv_cache_tokens=4096)
        r = make_request(alone, "x", prompt, s.sampling, max_tokens=6, ignore_eos=True)
        assert run_to_completion(alone, [r])["x"] == s.output_token_ids
    assert len({tuple(r.output_token_ids) for r in [leader, *siblings]}) == 3
    assert _pool_is_clean(engine)


def test_a_sibling_whose_leader_is_aborted_runs_alone(make_engine, golden):
    engine = make_engine()
    prompt = golden[1]["prompt_ids"]
    leader = make_request(engine, "l", prompt, GREEDY, max_tokens=3)
    sibling = make_request(engine, "s", prompt, GREEDY, max_tokens=3, prefill_leader="l")
    engine.add_request(leader)
    engine.add_request(sibling)
    engine.abort("l")
    assert {o.request_id for o in _drain(engine)} == {"s"}
    assert sibling.num_output_tokens == 3 and _pool_is_clean(engine)


def test_prompt_logprobs_equal_transformers_logprobs_of_the_same_tokens(make_engine, golden):
    """The golden greedy reply, sent back as part of the prompt: its tokens' prompt logprobs
    are the logprobs transformers gave them when it generated them."""
    engine = make_engine(prefill_chunk_len=512)
    for case in golden:
        k = 20
        prompt = case["prompt_ids"] + case["greedy_ids"][:k]
        req = make_request(engine, "p", prompt, GREEDY, max_tokens=1, prompt_logprobs=3)
        engine.add_request(req)
        entries = _drain(engine)[0].prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        assert [e.token_id for e in entries[1:]] == prompt[1:]
        reply = entries[len(case["prompt_ids"]):]
        for e, want in zip(reply, case["greedy_logprobs"][:k], strict=True):
            assert e.logprob == pytest.approx(want, abs=LOGPROB_ATOL)
            assert e.top[0][0] == e.token_id  # greedy tokens are each position's top-1
        assert req.num_cached_tokens == 0  # never from the prefix cache: every row is read
        assert _pool_is_clean(engine)


def test_prompt_logprobs_span_prefill_chunks(make_engine, golden):
    engine = make_engine(prefill_chunk_len=512)
    prompt = (golden[0]["prompt_ids"] + golden[0]["greedy_ids"]) * 12  # 828 tokens: 2 chunks
    once = make_request(engine, "a", prompt, GREEDY, max_tokens=1, prompt_logprobs=0)
    engine.add_request(once)
    entries = _drain(engine)[0].prompt_logprobs
    assert len(entries) == len(prompt) and once.num_prefill_chunks == 2
    # The same prompt cut at the chunk boundary: its entries are the first ones, bit for bit.
    cut = make_engine(prefill_chunk_len=512)
    short = make_request(cut, "b", prompt[:600], GREEDY, max_tokens=1, prompt_logprobs=0)
    cut.add_request(short)
    assert [e.logprob for e in _drain(cut)[0].prompt_logprobs[1:]] == \
        [e.logprob for e in entries[1:600]]


def test_min_tokens_keeps_stop_tokens_out_until_reached(make_engine, golden):
    engine = make_engine()
    case = golden[0]
    stop_at = case["greedy_ids"].index(2) + 1  # the golden reply ends with <|im_end|> (id 2)
    plain = make_request(engine, "a", case["prompt_ids"], GREEDY, max_tokens=30)
    assert run_to_completion(engine, [plain])["a"] == case["greedy_ids"][:stop_at]
    req = make_request(engine, "b", case["prompt_ids"], GREEDY, max_tokens=30,
                       min_tokens=stop_at + 5)
    out = run_to_completion(engine, [req])["b"]
    assert len(out) >= stop_at + 5
    assert not set(out[:stop_at + 5]) & engine.loaded.tokenizer.stop_token_ids
    assert out[:stop_at - 1] == case["greedy_ids"][:stop_at - 1]


def test_ignore_eos_runs_to_max_tokens(make_engine, golden):
    engine = make_engine()
    case = golden[0]
    req = make_request(engine, "a", case["prompt_ids"], GREEDY, max_tokens=20, ignore_eos=True)
    out = run_to_completion(engine, [req])["a"]
    assert len(out) == 20 and 2 in out and req.finish_reason == "length"
    # Past the stop token it is still the model's greedy continuation (golden to 32 tokens).
    assert out == case["greedy_ids"][:20]


def test_logit_bias_steers_and_bans(make_engine, golden):
    engine = make_engine()
    case = golden[0]
    forced = make_request(engine, "a", case["prompt_ids"], GREEDY, max_tokens=4,
                          logit_bias=((1234, 100.0),))
    assert run_to_completion(engine, [forced])["a"] == [1234] * 4
    first = case["greedy_ids"][0]
    banned = make_request(engine, "b", case["prompt_ids"], GREEDY, max_tokens=1,
                          logprobs=2, logit_bias=((first, -100.0),))
    engine.add_request(banned)
    outs = _drain(engine)
    # The runner-up of the raw distribution; its logprob is reported raw (before the bias).
    top = outs[0].new_logprobs[0].top
    assert top[0][0] == first and outs[0].new_token_ids == [top[1][0]]
    assert outs[0].new_logprobs[0].logprob == top[1][1]
