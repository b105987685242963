"""Speculative decoding (contract.md): a drafted token is kept when it equals the argmax of the
model's raw logits at its position, skips the sampler and stays out of the penalty window; the
first position that disagrees is sampled as usual. The engine with the real model, drafting by
prompt lookup on prompts whose replies copy them."""

import json

import pytest
from conftest import make_request, run_to_completion

from kiln.runtime.drafting.config import SpeculativeConfig
from kiln.runtime.drafting.ngram import NgramIndex
from kiln.runtime.drafting.pace import DraftPace
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.llm_engine import LLMEngine
from kiln.runtime.sampling.grammar import GrammarSpec
from kiln.runtime.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
SPEC = SpeculativeConfig()
CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
FREE = "Write a short poem about a lighthouse keeper who befriends a gull."


def copying(code: str = CODE) -> str:
    """A text whose continuation repeats it: what prompt lookup is for."""
    return (code + "\n\n") * 2 + code[:40]


def engine(smollm2, speculative=SPEC, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_tokens", 8192)
    return LLMEngine(smollm2, EngineConfig.build(smollm2.ctx_len, smollm2.max_prefill_len,
                                                 speculative=speculative, **kw))


def prompt(smollm2, text: str) -> list[int]:
    return smollm2.chat_prompt_ids([{"role": "user", "content": text}])


def generate(eng, requests) -> dict[str, list]:
    """Each request's (token, logprob, top) triples, in order."""
    for r in requests:
        eng.add_request(r)
    got = {r.request_id: [] for r in requests}
    while eng.has_unfinished():
        for out in eng.step():
            lps = out.new_logprobs or [None] * len(out.new_token_ids)
            got[out.request_id] += [(t, lp and (lp.logprob, lp.top))
                                    for t, lp in zip(out.new_token_ids, lps)]
    return got


@pytest.fixture(scope="module")
def copy_ids(smollm2):
    return smollm2.tokenizer.encode(copying())


def test_greedy_without_penalties_is_the_same_with_and_without_drafting(smollm2, copy_ids):
    outs = []
    for spec in (None, SPEC):
        eng = engine(smollm2, spec)
        req = make_request(eng, "a", copy_ids, GREEDY, max_tokens=80, logprobs=3)
        outs.append(generate(eng, [req])["a"])
        if spec:
            assert eng.num_accepted_tokens > 20, "the reply copies its prompt: drafts hold"
            assert req.num_accepted_tokens == eng.num_accepted_tokens
    assert outs[0] == outs[1]  # ids, logprobs and top logprobs, bit for bit


def test_a_seeded_reply_with_drafting_repeats_alone_batched_cached_and_cold(smollm2, copy_ids):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=42, presence_penalty=0.5,
                            repetition_penalty=1.1)
    eng = engine(smollm2)

    def one(rid, others=()):
        reqs = [make_request(eng, rid, copy_ids, seeded, max_tokens=60, logprobs=1)]
        reqs += [make_request(eng, f"{rid}-{i}", prompt(smollm2, text), seeded, max_tokens=40)
                 for i, text in enumerate(others)]
        return generate(eng, reqs)[rid]

    cold = one("cold")
    cached = one("cached")
    batched = one("batched", [FREE, "Name three rivers.", "Repeat: " + CODE])
    assert cold == cached == batched
    assert engine(smollm2, None).num_accepted_tokens == 0  # (a fresh engine counts from 0)


def test_kept_drafts_stay_out_of_the_penalty_window(smollm2, copy_ids):
    """Penalties shape only the tokens the model samples: a kept draft is not in the window."""
    eng = engine(smollm2)
    req = make_request(eng, "a", copy_ids, SamplingParams(temperature=0.0, presence_penalty=1.0,
                                                          repeat_last_n=-1), max_tokens=80)
    run_to_completion(eng, [req])
    assert req.num_accepted_tokens > 10
    assert len(req.window_token_ids) == req.num_output_tokens - req.num_accepted_tokens


def test_a_draft_is_kept_only_where_the_grammar_allows_it(smollm2):
    schema = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
    ids = prompt(smollm2, f'Answer as JSON: {{"code": "..."}} holding this code:\n{CODE}')
    outs = []
    for spec in (None, SPEC):
        eng = engine(smollm2, spec)
        req = make_request(eng, "g", ids, GREEDY, max_tokens=120,
                           grammar=GrammarSpec.json_schema(schema))
        run_to_completion(eng, [req])
        outs.append(req.output_token_ids)
    assert outs[0] == outs[1]
    text = smollm2.tokenizer.decode(outs[1], skip_special_tokens=True)
    if outs[1][-1] in smollm2.tokenizer.stop_token_ids:  # finished: the object parses
        assert "code" in json.loads(text)


@pytest.mark.parametrize("stop", ["return width", "perimeter("], ids=["early", "late"])
def test_a_stop_string_inside_a_kept_run_ends_the_reply_where_it_would(smollm2, copy_ids,
                                                                       stop):
    outs = []
    for spec in (None, SPEC):
        eng = engine(smollm2, spec)
        req = make_request(eng, "s", copy_ids, GREEDY, max_tokens=120, stop=(stop,))
        run_to_completion(eng, [req])
        outs.append((req.output_token_ids, req.finish_reason))
    assert outs[0] == outs[1] and outs[1][1] == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 17])
def test_max_tokens_is_never_exceeded(smollm2, copy_ids, max_tokens):
    eng = engine(smollm2)
    req = make_request(eng, "m", copy_ids + copy_ids[-40:], GREEDY, max_tokens=max_tokens,
                       ignore_eos=True)
    assert len(run_to_completion(eng, [req])["m"]) == max_tokens
    assert req.finish_reason == "length"


def test_logit_bias_and_min_tokens_hold_for_drafts(smollm2, copy_ids):
    """A bias bans a token the copy would write, min_tokens keeps the stop token out: the
    drafts the model agrees with are checked against those constraints too."""
    banned = smollm2.tokenizer.encode(" height", add_special_tokens=False)[0]
    eos = min(smollm2.tokenizer.stop_token_ids)
    outs = []
    for spec in (None, SPEC):
        eng = engine(smollm2, spec)
        req = make_request(eng, "b", copy_ids, GREEDY, max_tokens=90, min_tokens=85,
                           logit_bias=((banned, -100.0),))
        outs.append(run_to_completion(eng, [req])["b"])
        assert banned not in outs[-1] and eos not in outs[-1][:85]
    assert outs[0] == outs[1]


def test_preempted_drafting_requests_lose_nothing(smollm2):
    prompts = [smollm2.tokenizer.encode(copying(CODE.replace("rectangle", shape)))
               for shape in ("square", "field", "table", "window")]
    alone = {}
    for i, ids in enumerate(prompts):
        eng = engine(smollm2)
        alone |= run_to_completion(eng, [make_request(eng, f"r{i}", ids, GREEDY,
                                                      max_tokens=60)])
    eng = engine(smollm2, kv_cache_tokens=512, max_num_seqs=4)  # room for about three
    reqs = [make_request(eng, f"r{i}", ids, GREEDY, max_tokens=60)
            for i, ids in enumerate(prompts)]
    assert run_to_completion(eng, reqs) == alone
    assert eng.scheduler.num_preemptions > 0 and eng.num_accepted_tokens > 0
    assert eng.kv.block_pool.get_num_free_blocks() == eng.config.num_blocks


def test_blocks_are_indexed_as_they_fill_and_tables_follow_trims(smollm2, copy_ids):
    """A step indexes a request's blocks when one fills (kept drafts fill several at once,
    rejected drafts trim slots off): after every step each running request's full computed
    blocks are in the prefix cache, and the runner's table rows (one gather of all of them)
    hold exactly its blocks, zero past them."""
    eng = engine(smollm2)
    for i, ids in enumerate([copy_ids, prompt(smollm2, FREE)]):
        eng.add_request(make_request(eng, f"r{i}", ids, GREEDY, max_tokens=70))
    bs = eng.config.block_size
    while eng.has_unfinished():
        eng.step()
        running = eng.scheduler.running
        tables = eng.kv.block_tables(running)
        for req, row in zip(running, tables.tolist()):
            blocks = eng.kv.req_to_blocks[req.request_id]
            assert all(b.block_hash is not None for b in blocks[:req.num_computed_tokens // bs])
            ids = eng.kv.get_block_ids(req)
            assert row == ids + [0] * (len(row) - len(ids))
    assert eng.num_accepted_tokens > 0 and eng.num_draft_tokens > eng.num_accepted_tokens


class WrongDrafter:
    """Drafts the model never agrees with: what text the context does not foretell costs."""

    def propose(self, requests, lengths):
        return [[req.all_token_ids[-1] + 1] * k for req, k in zip(requests, lengths)]


def test_drafts_that_keep_missing_are_soon_hardly_made(smollm2):
    ids = prompt(smollm2, FREE)
    plain = engine(smollm2, None)
    want = run_to_completion(plain, [make_request(plain, "f", ids, GREEDY, max_tokens=150)])
    eng = engine(smollm2)
    eng.drafter = WrongDrafter()
    req = make_request(eng, "f", ids, GREEDY, max_tokens=150)
    assert run_to_completion(eng, [req]) == want
    # Three misses in a row pause drafting for 2 steps, then 4, 8, ... 64: of 150 steps, 9
    # check drafts (at steps 1, 2, 3, 6, 11, 20, 37, 70 and 135).
    k = SPEC.num_speculative_tokens
    assert req.num_accepted_tokens == 0 and req.num_drafted_tokens <= 9 * k, req.draft_pace


def test_under_load_only_replies_drafting_cannot_change_stop_drafting(smollm2, copy_ids):
    eng = engine(smollm2, SpeculativeConfig(disable_by_batch_size=1))
    greedy = [make_request(eng, f"g{i}", copy_ids, GREEDY, max_tokens=24, ignore_eos=True)
              for i in range(2)]
    seeded = make_request(eng, "s", copy_ids, SamplingParams(temperature=0.5, seed=1),
                          max_tokens=24, ignore_eos=True)
    penalized = make_request(eng, "p", copy_ids, SamplingParams(temperature=0.0,
                             repetition_penalty=1.05), max_tokens=24, ignore_eos=True)
    biased = make_request(eng, "b", copy_ids, GREEDY, max_tokens=24, ignore_eos=True,
                          logit_bias=((0, 1.0),))
    # more than one running: the greedy ones never draft (a logit_bias is part of the
    # model's choice drafts are checked against: drafting still changes nothing); the
    # seeded and penalised ones draft as alone, by their pace, and end first
    got = generate(eng, greedy + [biased, seeded, penalized])
    assert [r.num_drafted_tokens for r in greedy + [biased]] == [0, 0, 0]
    assert min(r.num_drafted_tokens for r in (seeded, penalized)) > 0
    alone = make_request(eng, "a", copy_ids, GREEDY, max_tokens=24, ignore_eos=True)
    assert generate(eng, [alone])["a"] == got["g0"] == got["g1"]  # the same reply ...
    assert alone.num_accepted_tokens > 0  # ... drafted: one request running


def test_the_load_limit_is_the_cpus_measured_one_unless_told():
    def limit(device, spec):
        return EngineConfig.build(4096, 512, device=device, speculative=spec).draft_batch_limit

    assert limit("cpu", SPEC) == 8 and limit("cuda", SPEC) == 0 and limit("cpu", None) == 0
    assert limit("cpu", SpeculativeConfig(disable_by_batch_size=0)) == 0
    assert limit("cuda", SpeculativeConfig(disable_by_batch_size=32)) == 32
    with pytest.raises(ValueError, match="disable-by-batch-size"):
        SpeculativeConfig(disable_by_batch_size=-1)


# --- the pieces, without the model ---

def test_prompt_lookup_proposes_what_followed_the_latest_earlier_match():
    index = NgramIndex(2, 3)
    assert index.propose([1, 2, 3, 4, 9, 2, 3], 3) == [4, 9]  # "2 3" was followed by 4 9
    index.extend([1, 2, 3, 4, 9, 2, 3, 4])
    assert index.propose([1, 2, 3, 4, 9, 2, 3, 4], 2) == [9, 2]  # "2 3 4": the longest
    assert NgramIndex(2, 3).propose([5, 6, 7, 8], 4) == []  # nothing repeats
    assert NgramIndex(2, 2).propose([7, 7, 7], 4) == [7]  # up to the end


def test_a_draft_is_no_longer_than_the_match_that_proposed_it():
    copied = list(range(100, 120))
    text = copied + [5, 6] + copied[:6]  # the end repeats 6 tokens of the start
    assert NgramIndex(2, 8).propose(text, 16) == copied[6:12]
    assert NgramIndex(2, 8).propose(text, 4) == copied[6:10]  # and no longer than k
    assert NgramIndex(2, 3).propose(text, 16) == copied[6:9]  # a match counts to ngram_max
    assert NgramIndex(2, 8).propose(copied + [5, 6, 100, 101], 8) == copied[2:4]


def test_pace_pauses_after_three_misses_in_a_row_for_longer_each_time():
    pace = DraftPace(4)
    assert pace.next_length() == 4
    pace.record(4, 0)
    pace.record(4, 1)  # a kept token ends the streak
    pace.record(4, 0)
    pace.record(4, 0)
    assert pace.next_length() == 4  # two misses in a row: drafts go on, as long
    pace.record(4, 0)  # three: a pause of 2 steps, then 4, 8, ... 64
    assert [pace.next_length() for _ in range(3)] == [0, 0, 4]
    pace.record(4, 0)
    assert [pace.next_length() for _ in range(5)] == [0, 0, 0, 0, 4]
    for _ in range(10):
        pace.record(4, 0)
    assert pace.pause == 64
    pace.record(0, 0)  # a step that drafted nothing changes nothing
    assert pace.pause == 64 and pace.misses == 14
