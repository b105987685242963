"""The engine with the real model: prefix cache, batching, preemption, context checks."""

import pytest
from conftest import make_request, run_to_completion

from kiln.api.errors import error_response
from kiln.runtime.errors import ContextLengthError
from kiln.runtime.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0)


def _prompt(smollm2, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return smollm2.tokenizer.encode(smollm2.chat_template.render(msgs), add_special_tokens=False)


def _pool_is_clean(engine) -> bool:
    pool = engine.kv.block_pool
    return pool.get_num_free_blocks() == pool.num_blocks and \
        all(b.ref_cnt == 0 for b in pool.blocks) and not engine.kv.req_to_blocks


def test_repeated_600_token_prefix_is_served_from_the_cache(smollm2, make_engine):
    engine = make_engine(kv_cache_tokens=2048)
    prefix = list(range(1000, 1600))  # 600 tokens
    first = make_request(engine, "a", prefix, GREEDY, max_tokens=8)
    out_a = run_to_completion(engine, [first])["a"]
    assert first.num_cached_tokens == 0
    second = make_request(engine, "b", prefix, GREEDY, max_tokens=8)
    out_b = run_to_completion(engine, [second])["b"]
    assert second.num_cached_tokens == 592  # 37 full blocks; the last token is recomputed
    assert out_b == out_a
    # Enough other traffic to evict it: the pool holds 128 blocks.
    for i in range(3):
        other = make_request(engine, f"o{i}", list(range(2000 + 700 * i, 2700 + 700 * i)),
                             GREEDY, max_tokens=2)
        run_to_completion(engine, [other])
    third = make_request(engine, "c", prefix, GREEDY, max_tokens=8)
    out_c = run_to_completion(engine, [third])["c"]
    assert third.num_cached_tokens == 0
    assert out_c == out_a
    assert _pool_is_clean(engine)


PROMPTS = ["What is the capital of France?", "Name a colour.", "Count to five.",
           "Write a short poem about rain.", "What is 2 + 2?", "Say hello in Spanish.",
           "Describe a cat in one sentence.", "What is the largest planet?"]


@pytest.fixture(scope="module")
def solo_outputs(smollm2):
    from kiln.runtime.engine.config import EngineConfig
    from kiln.runtime.engine.llm_engine import LLMEngine

    cfg = EngineConfig.build(smollm2.ctx_len, smollm2.max_prefill_len, kv_cache_tokens=4096)
    outs = {}
    for i, text in enumerate(PROMPTS):
        engine = LLMEngine(smollm2, cfg)
        req = make_request(engine, f"r{i}", _prompt(smollm2, text), GREEDY, max_tokens=24)
        outs[f"r{i}"] = run_to_completion(engine, [req])[f"r{i}"]
    return outs


def test_8_concurrent_greedy_requests_match_their_solo_runs(smollm2, make_engine, solo_outputs):
    engine = make_engine(kv_cache_tokens=4096)
    reqs = [make_request(engine, f"r{i}", _prompt(smollm2, t), GREEDY, max_tokens=24)
            for i, t in enumerate(PROMPTS)]
    outs = run_to_completion(engine, reqs)
    texts = {k: smollm2.tokenizer.decode(v) for k, v in outs.items()}
    solo = {k: smollm2.tokenizer.decode(v) for k, v in solo_outputs.items()}
    assert texts == solo
    assert _pool_is_clean(engine)


def test_exhausted_pool_preempts_and_queues_without_losing_a_request(
        smollm2, make_engine, solo_outputs, caplog):
    # 14 blocks (224 tokens) cannot hold 8 prompts of ~40 tokens growing by 24 each.
    engine = make_engine(kv_cache_tokens=224)
    reqs = [make_request(engine, f"r{i}", _prompt(smollm2, t), GREEDY, max_tokens=24)
            for i, t in enumerate(PROMPTS)]
    with caplog.at_level("INFO", logger="kiln"):
        outs = run_to_completion(engine, reqs)
    assert any("Preempted" in r.getMessage() for r in caplog.records)
    assert {k: smollm2.tokenizer.decode(v) for k, v in outs.items()} == \
        {k: smollm2.tokenizer.decode(v) for k, v in solo_outputs.items()}
    assert all(r.finish_reason in ("stop", "length") for r in reqs)
    assert _pool_is_clean(engine)


def test_prompt_as_long_as_the_context_is_rejected_before_prefill(make_engine):
    engine = make_engine(ctx_len=512, kv_cache_tokens=1024)
    with pytest.raises(ContextLengthError) as err:
        make_request(engine, "a", [5] * 512, GREEDY)
    assert error_response(err.value, "a") == (400, {"error": {
        "message": "Max length reached!", "type": "model_error", "param": None, "code": 400}})
    with pytest.raises(ContextLengthError):
        make_request(engine, "b", [5] * 500, GREEDY, max_tokens=13)
    make_request(engine, "c", [5] * 500, GREEDY, max_tokens=12)  # fits exactly
    assert _pool_is_clean(engine)


def test_generation_that_fills_the_context_stops_with_length(make_engine):
    engine = make_engine(ctx_len=512, kv_cache_tokens=1024)
    req = make_request(engine, "a", [5] * 506, SamplingParams(temperature=0.0), ignore_eos=True)
    out = run_to_completion(engine, [req])["a"]
    assert len(out) == 6 and req.finish_reason == "length"
    assert req.num_tokens == 512


def test_abort_frees_the_request_blocks_between_steps(smollm2, make_engine):
    engine = make_engine(kv_cache_tokens=2048, prefill_chunk_len=512)
    req = make_request(engine, "a", list(range(1000, 2200)), GREEDY, max_tokens=4)
    engine.add_request(req)
    engine.step()  # first 512-token chunk
    assert req.num_computed_tokens == 512
    out = engine.abort("a")
    assert out.finish_reason == "abort" and not engine.has_unfinished()
    assert _pool_is_clean(engine)
    # Its full blocks stay cached for the next request with the same prefix.
    again = make_request(engine, "b", list(range(1000, 2200)), GREEDY, max_tokens=1)
    run_to_completion(engine, [again])
    assert again.num_cached_tokens == 512


def test_a_request_the_whole_pool_cannot_hold_is_refused_and_others_are_capped(make_engine):
    """--kv-cache-tokens 1024 under a 4096 context: 2,000 prompt tokens used to wait (and
    spin) for ever after their preemption. Now: refused before anything is allocated; a
    reply without max_tokens ends, "length", where the pool is full."""
    from kiln.runtime.errors import KVCacheCapacityError

    engine = make_engine(kv_cache_tokens=1024, ctx_len=4096)
    prompt = list(range(1000, 3000))
    with pytest.raises(KVCacheCapacityError) as exc:
        make_request(engine, "big", prompt, GREEDY)
    assert error_response(exc.value, "x")[0] == 400
    with pytest.raises(KVCacheCapacityError):
        make_request(engine, "fits-not", prompt[:1000], GREEDY, max_tokens=100)
    assert _pool_is_clean(engine)
    req = make_request(engine, "capped", prompt[:1000], SamplingParams(temperature=1.0, seed=1))
    assert req.max_tokens == 24  # 1024 - 1000
    out = run_to_completion(engine, [req])["capped"]
    assert len(out) <= 24 and req.finish_reason in ("length", "stop")
    assert _pool_is_clean(engine)


def test_a_step_that_can_schedule_nothing_marks_the_engine_stalled(make_engine, monkeypatch):
    """The engine thread then waits for its inbox instead of stepping in a loop."""
    engine = make_engine(kv_cache_tokens=1024)
    req = make_request(engine, "r", [1, 2, 3], GREEDY, max_tokens=2)
    engine.add_request(req)
    monkeypatch.setattr(engine.kv, "allocate_slots", lambda *a, **k: False)
    assert engine.step() == [] and engine.stalled
    monkeypatch.undo()
    engine.step()
    assert not engine.stalled


def test_a_stop_string_ends_the_request_in_the_step_that_produced_it(smollm2, make_engine):
    """Greedy, the model counts on: with stop " 17" the last output token is the one that
    completes " 17", and the request's blocks are free right after that step."""
    engine = make_engine(kv_cache_tokens=2048)
    prompt = smollm2.tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
                                      add_special_tokens=False)
    req = make_request(engine, "s", prompt, GREEDY, max_tokens=40, stop=[" 17"])
    out = run_to_completion(engine, [req])["s"]
    text = smollm2.tokenizer.decode(out)
    assert " 17" in text and " 17" not in smollm2.tokenizer.decode(out[:-1]), text
    assert req.finish_reason == "stop"
    assert _pool_is_clean(engine)


def test_a_stop_token_id_ends_the_reply_where_it_is_produced(smollm2, make_engine):
    """stop_token_ids (vLLM's): more tokens that end a reply, beside the model's own."""
    prompt = smollm2.tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
                                      add_special_tokens=False)
    engine = make_engine(kv_cache_tokens=2048)
    full = run_to_completion(engine, [make_request(engine, "a", prompt, GREEDY, max_tokens=12)])
    stop = full["a"][5]
    req = make_request(engine, "b", prompt, GREEDY, max_tokens=12,
                       stop_token_ids=frozenset({stop}))
    assert run_to_completion(engine, [req])["b"] == full["a"][:full["a"].index(stop) + 1]
    assert req.finish_reason == "stop" and _pool_is_clean(engine)
