"""--async-scheduling: a step launched before the host reads the last one's tokens gives every
request the tokens, logprobs and finish of the synchronous engine (the oracle: kiln's bits do
not depend on the batch), under requests ending on the token in flight, penalty windows
taking their newest token on the device, a row whose sampler needs its tokens on the host
(a grammar) beside them, requests joining and leaving, aborts and preemption, and leaves no
KV block behind.

On the CPU nothing overlaps (the host computes the step), but every part of the path runs:
the scheduler counting tokens in flight, inputs taken from the last step's samples, seeded
draws' offsets, the late reads and the rows computed in vain."""

from dataclasses import replace

import pytest
from conftest import make_request

from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.llm_engine import LLMEngine
from kiln.runtime.sampling.grammar import GrammarSpec
from kiln.runtime.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0)


def _engine(model, async_scheduling: bool, **kw) -> LLMEngine:
    cfg = EngineConfig.build(model.ctx_len, model.max_prefill_len, **kw)
    return LLMEngine(model, replace(cfg, async_scheduling=async_scheduling))


def _prompt(smollm2, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return smollm2.tokenizer.encode(smollm2.chat_template.render(msgs), add_special_tokens=False)


def _run(engine, requests, late=(), abort_at=None):
    """Step to the end: `requests` from the start, `late` after the third step, the request
    `abort_at[0]` aborted once it has abort_at[1] tokens. Returns per request its (token,
    logprob) pairs and finish reason, and the steps that ended with a step in flight."""
    for r in requests:
        engine.add_request(r)
    out = {r.request_id: [] for r in (*requests, *late)}
    reasons, steps, in_flight = {}, 0, 0
    while engine.has_unfinished() or late:
        if steps == 3:
            for r in late:
                engine.add_request(r)
            late = ()
        outputs = engine.step()
        if abort_at and len(out[abort_at[0]]) >= abort_at[1] and abort_at[0] not in reasons:
            outputs += [engine.abort(abort_at[0])]
        for o in outputs:
            out[o.request_id] += [(lp.token_id, lp.logprob) for lp in o.new_logprobs or ()]
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        steps += 1
        in_flight += engine.in_flight is not None
        assert steps < 2000
    return out, reasons, in_flight


def _requests(engine, smollm2, stops):
    """Greedy and seeded replies of several lengths, one ending on a stop token its sync run
    produced (`stops`), one with min_tokens over a stop token, one with penalties, one with
    a grammar."""
    texts = ["What is the capital of France?", "Count to five.", "Name a colour.",
             "Write a short poem about rain.", "Say hello in Spanish.", "What is 2 + 2?"]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.0)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0,
                               repeat_last_n=6)  # a ring of 6 that wraps
    settings = [(GREEDY, dict(max_tokens=12)), (seeded, dict(max_tokens=20)),
                (GREEDY, dict(max_tokens=16, stop_token_ids=stops[0])),
                (seeded, dict(max_tokens=14, min_tokens=6, stop_token_ids=stops[1])),
                (penalised, dict(max_tokens=16)), (GREEDY, dict(max_tokens=4))]
    settings[-1][1]["grammar"] = GrammarSpec("json_object")  # steps with it wait
    return [make_request(engine, f"r{i}", _prompt(smollm2, t), sp, logprobs=1, **opts)
            for i, (t, (sp, opts)) in enumerate(zip(texts, settings, strict=True))]


@pytest.fixture(scope="module")
def stops(smollm2):
    """Stop tokens taken from replies without them: the 5th token of r2's, the 7th of r3's
    (the first that its min_tokens 6 lets through)."""
    engine = _engine(smollm2, False, kv_cache_tokens=4096)
    reqs = _requests(engine, smollm2, (frozenset(), frozenset()))
    out, _, _ = _run(engine, reqs)
    return frozenset({out["r2"][4][0]}), frozenset({out["r3"][6][0]})


def _pool_is_clean(engine) -> bool:
    pool = engine.kv.block_pool
    return pool.get_num_free_blocks() == pool.num_blocks and not engine.kv.req_to_blocks


@pytest.mark.parametrize("kv_cache_tokens", [4096, 80], ids=["roomy", "preempting"])
def test_async_steps_give_the_synchronous_replies(smollm2, stops, kv_cache_tokens):
    runs, preempted = {}, {}
    for overlap in (False, True):
        engine = _engine(smollm2, overlap, kv_cache_tokens=kv_cache_tokens, max_num_seqs=8)
        reqs = _requests(engine, smollm2, stops)
        late = [make_request(engine, "late", _prompt(smollm2, "Describe a cat."), GREEDY,
                             logprobs=1, max_tokens=9)]
        runs[overlap] = _run(engine, reqs[:-2], late=reqs[-2:] + late)
        preempted[overlap] = engine.scheduler.num_preemptions
        assert _pool_is_clean(engine)
        assert all(r.num_in_flight == 0 for r in reqs)
    (sync, sync_reasons, none), (out, reasons, in_flight) = runs[False], runs[True]
    assert none == 0 and in_flight >= 5  # the overlap did happen
    assert out == sync and reasons == sync_reasons
    assert reasons["r2"] == "stop" and len(out["r2"]) == 5  # ended on the token in flight
    assert reasons["r3"] == "stop" and len(out["r3"]) == 7  # min_tokens' count ahead of it
    if kv_cache_tokens == 80:  # 5 blocks for ~50-token replies
        assert preempted[True] > 0


def test_an_abort_with_a_token_in_flight_frees_everything(smollm2, stops):
    sync, _, _ = _run(e := _engine(smollm2, False, kv_cache_tokens=4096),
                      _requests(e, smollm2, stops))
    engine = _engine(smollm2, True, kv_cache_tokens=4096)
    out, reasons, _ = _run(engine, _requests(engine, smollm2, stops), abort_at=("r1", 4))
    assert reasons["r1"] == "abort" and out["r1"] == sync["r1"][:len(out["r1"])]
    assert {k: v for k, v in out.items() if k != "r1"} == \
        {k: v for k, v in sync.items() if k != "r1"}
    assert _pool_is_clean(engine)


@pytest.mark.parametrize("beside", [None, "grammar"])
def test_a_reply_ending_on_its_token_in_flight_has_nothing_after_it(smollm2, beside):
    """The step after a reply's stop token computes its row in vain and fills a block with
    it; that step reads the stop token after launching (alone), or before sampling, for a
    request with a grammar joining it (beside): the reply ends there either way, and the
    block it filled is neither indexed nor leaked."""
    k = 3  # the stop is the reply's 4th token: its row in vain is at position L + k
    prompt = list(range(1000, 1000 + 16 * 3 - (k + 1)))  # L + k + 1 fills the third block
    ref_engine = _engine(smollm2, False, kv_cache_tokens=4096)
    ref = [t for t, _ in _run(ref_engine, [make_request(ref_engine, "a", prompt, GREEDY,
                                                        logprobs=1, max_tokens=8)])[0]["a"]]
    assert ref[k] not in ref[:k]
    engine = _engine(smollm2, True, kv_cache_tokens=4096)
    a = make_request(engine, "a", prompt, GREEDY, max_tokens=8,
                     stop_token_ids=frozenset({ref[k]}))
    engine.add_request(a)
    got = []
    while a.num_output_tokens + a.num_in_flight <= k:
        got += [t for o in engine.step() for t in o.new_token_ids]
    assert a.num_in_flight == 1 and not a.is_finished  # its stop token is in flight
    if beside:  # its grammar's mask needs its tokens on the host: the step waits
        engine.add_request(make_request(engine, "b", list(range(3000, 3020)), GREEDY,
                                        max_tokens=2, grammar=GrammarSpec("json_object")))
    while engine.has_unfinished():
        got += [t for o in engine.step() if o.request_id == "a" for t in o.new_token_ids]
    assert got == ref[:k + 1] and a.finish_reason == "stop"
    # a's two full blocks of prompt, b's one; not the block a's row in vain filled
    assert len(engine.kv.block_pool.cached_block_hash_to_block) == 2 + bool(beside)
    assert _pool_is_clean(engine)
