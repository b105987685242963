"""kiln/runtime/grammar.py: specs, the compile cache, per-request matchers and the batch bitmask,
with SmolLM2's real vocabulary. Oracles: the token texts themselves (a mask that allows `{`
must allow only tokens a JSON object can start with) and jsonschema for the instances."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import make_request

from kiln.api.errors import http_status
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.sampling.grammar import (
    GrammarCompilerCache,
    GrammarSpec,
    GrammarState,
    build_grammar_bitmask,
)
from kiln.runtime.text.tokenizer import Tokenizer

V = 49152  # SmolLM2's vocabulary and logits width

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string"},
                          "days": {"type": "integer", "minimum": 1},
                          "units": {"enum": ["C", "F"]},
                          "hours": {"type": "array", "items": {"type": "number"}}},
           "required": ["city", "days", "units", "hours"]}


@pytest.fixture(scope="module")
def tok(smollm2_gguf):
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def grammars(tok):
    return GrammarCompilerCache(tok, vocab_size=V)


def allowed(bitmask: torch.Tensor, row: int = 0) -> torch.Tensor:
    """Bit j of word w allows token 32 * w + j: [V] bool."""
    words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
    bits = (words[:, None] >> torch.arange(32)) & 1
    return bits.flatten().bool()


def mask_of(state: GrammarState, width: int = V // 32) -> torch.Tensor:
    bitmask = torch.full((1, width), -1, dtype=torch.int32)
    state.fill_bitmask(bitmask, 0)
    return allowed(bitmask)


def test_equal_specs_share_one_compiled_grammar(tok):
    cache = GrammarCompilerCache(tok, vocab_size=V, capacity=2)
    a = GrammarSpec.json_schema(WEATHER)
    first = cache.get(a)
    assert cache.get(GrammarSpec.json_schema(json.loads(json.dumps(WEATHER)))) is first
    # The field blamed for errors is not part of the key.
    assert cache.get(GrammarSpec.json_schema(WEATHER, param="tools")) is first
    assert (cache.hits, cache.misses) == (2, 1)
    cache.get(GrammarSpec("json_object"))
    cache.get(GrammarSpec("regex", "[0-9]+"))  # evicts the least recently used: the schema
    assert cache.misses == 3
    assert cache.get(a) is not first and cache.misses == 4


def test_compiles_from_several_threads_at_once(tok):
    cache = GrammarCompilerCache(tok, vocab_size=V)
    specs = [GrammarSpec("regex", f"[a-z]{{{n}}}") for n in range(1, 5)] * 3
    with ThreadPoolExecutor(4) as pool:
        compiled = list(pool.map(cache.get, specs))
    for spec, c in zip(specs, compiled, strict=True):
        assert cache.get(spec) is not None
        state = GrammarState(c)
        n = int(spec.text[6:-1])
        assert state.matcher.accept_string("a" * n) and state.is_completed()


def test_json_schema_mask_allows_only_an_object_start(grammars, tok):
    ok = mask_of(GrammarState(grammars.get(GrammarSpec.json_schema(WEATHER))))
    assert ok[tok.encode("{")[0]]
    for word in ("a", "Hello", " the", "[", '"', "1"):
        ids = tok.encode(word)
        assert len(ids) == 1 and not ok[ids[0]], word
    texts = {tok.decode([i]) for i in ok.nonzero()[:, 0].tolist()}
    assert texts and all(t.lstrip().startswith("{") or not t.strip() for t in texts), texts


def test_valid_json_steps_through_token_by_token_then_stops(grammars, tok):
    jsonschema = pytest.importorskip("jsonschema")
    instance = {"city": "Zürich \"old\" town", "days": 3, "units": "C", "hours": [1.5, -2e3]}
    jsonschema.validate(instance, WEATHER)
    state = GrammarState(grammars.get(GrammarSpec.json_schema(WEATHER)))
    ids = tok.encode(json.dumps(instance, ensure_ascii=False), add_special_tokens=False)
    for i in ids:
        assert mask_of(state)[i], tok.decode([i])
        assert state.accept(i), tok.decode([i])
    assert state.is_completed() and not state.is_terminated()
    # Complete: only the stop tokens are left, and accepting one ends the request.
    assert set(mask_of(state).nonzero()[:, 0].tolist()) == set(tok.stop_token_ids)
    assert state.accept(tok.encode("<|im_end|>")[0]) and state.is_terminated()


def test_a_token_outside_the_grammar_is_refused_and_changes_nothing(grammars, tok):
    state = GrammarState(grammars.get(GrammarSpec.json_schema(WEATHER)))
    assert not state.accept(tok.encode("Hello")[0])
    assert state.accept(tok.encode("{")[0])


def test_json_object_mode_takes_any_object_but_not_other_values(grammars):
    compiled = grammars.get(GrammarSpec("json_object"))
    assert GrammarState(compiled).matcher.accept_string('{"any": [1, {"x": null}]}')
    for text in ("[1]", '"s"', "3"):
        assert not GrammarState(compiled).matcher.accept_string(text), text


@pytest.mark.parametrize("schema", [
    {"type": "objekt"},
    {"type": "object", "properties": 5},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
    {"type": 3},
])
def test_invalid_schema_is_a_400_on_response_format(grammars, schema):
    with pytest.raises(InvalidRequestError) as err:
        grammars.get(GrammarSpec.json_schema(schema))
    assert err.value.param == "response_format" and http_status(err.value) == 400
    assert "Invalid JSON schema" in err.value.message and ".cc:" not in err.value.message


def test_schema_that_is_not_an_object_is_a_400():
    with pytest.raises(InvalidRequestError) as err:
        GrammarSpec.json_schema([1, 2])
    assert err.value.param == "response_format"


def test_bad_regex_names_the_spec_param(grammars):
    with pytest.raises(InvalidRequestError) as err:
        grammars.get(GrammarSpec("regex", "a((", param="response_format.regex"))
    assert err.value.param == "response_format.regex"


def test_control_tokens_never_allowed_inside_a_string(grammars, tok):
    state = GrammarState(grammars.get(GrammarSpec.json_schema(WEATHER)))
    assert state.matcher.accept_string('{"city": "')
    ok = mask_of(state)
    assert ok[tok.encode("Paris")[0]]
    controls = sorted(tok.special_token_ids)
    assert controls and not any(ok[i] for i in controls)


def test_batch_bitmask_is_all_ones_for_rows_without_grammar(grammars):
    state = GrammarState(grammars.get(GrammarSpec.json_schema(WEATHER)))
    assert build_grammar_bitmask([None, None], V) is None
    bitmask = build_grammar_bitmask([None, state, None], V)
    assert bitmask.shape == (3, V // 32) and bitmask.dtype == torch.int32
    assert (bitmask[0] == -1).all() and (bitmask[2] == -1).all()
    assert torch.equal(allowed(bitmask, 1), mask_of(state))


def test_padded_model_vocab_masks_the_ids_past_the_tokenizer(tok):
    padded = 49152 + 40  # a logits width that is not a multiple of 32
    cache = GrammarCompilerCache(tok, vocab_size=padded)
    assert cache.bitmask_width == -(-padded // 32)
    state = GrammarState(cache.get(GrammarSpec("json_object")))
    bitmask = build_grammar_bitmask([state, None], padded)
    assert bitmask.shape == (2, cache.bitmask_width)
    assert not allowed(bitmask, 0)[tok.vocab_size:padded].any()
    assert state.matcher.accept_string('{"a": 1}')
    bitmask = build_grammar_bitmask([state], padded)
    assert allowed(bitmask, 0)[:padded].nonzero()[:, 0].tolist() == sorted(tok.stop_token_ids)


def test_continued_message_is_accepted_first(grammars):
    compiled = grammars.get(GrammarSpec.json_schema(WEATHER))
    state = GrammarState(compiled, prefix='{"city": "Pa')
    assert state.matcher.accept_string('ris", "days": 2, "units": "F", "hours": []}')
    with pytest.raises(InvalidRequestError) as err:
        GrammarState(compiled, prefix="Sure, here it is")
    assert err.value.param == "continue_final_message"


def test_spec_checks_its_kind_and_text():
    with pytest.raises(ValueError, match="not one of"):
        GrammarSpec("yaml", "a: 1")
    with pytest.raises(ValueError, match="needs its text"):
        GrammarSpec("regex")
    assert hash(GrammarSpec("regex", "a")) == hash(GrammarSpec("regex", "a", param="x"))


def test_dictated_tokens_are_the_ones_the_grammar_leaves_no_choice_of(grammars, tok):
    """A token is dictated when its text starts the jump-forward string: the fixed text of
    the grammar (an EBNF literal), not a token the model chose among others."""
    compiled = grammars.get(GrammarSpec("ebnf", 'root ::= "The answer is: " [a-z]+ "."'))
    state = GrammarState(compiled, token_bytes=grammars.token_bytes)
    head = tok.encode("The answer is: ", add_special_tokens=False)
    for t in head:
        assert state.dictates(t), grammars.token_bytes[t]
        assert state.accept(t)
    word = tok.encode("paris", add_special_tokens=False)
    assert not state.dictates(word[0]) and state.accept(word[0])


def test_dictated_tokens_stay_out_of_the_penalty_window(make_engine, smollm2):
    """The model's own choices enter the window; the grammar's fixed text does not, so
    repetition in a fixed head (a tool call's quotes and newlines) is not penalised."""
    from kiln.runtime.sampling.params import SamplingParams

    engine = make_engine()
    spec = GrammarSpec(
        "ebnf", 'root ::= "Answer: \\"" [a-z]+ "\\"\\nAnswer: \\"" [a-z]+ "\\""')
    prompt = smollm2.tokenizer.encode("Name two colours.", add_special_tokens=False)
    req = make_request(engine, "g", prompt, SamplingParams(temperature=0.0, presence_penalty=2.0,
                                                   repetition_penalty=2.0),
                       max_tokens=24, grammar=spec)
    engine.add_request(req)
    while engine.has_unfinished():
        engine.step()
    out, decode = req.output_token_ids, smollm2.tokenizer.decode
    text = decode(out)
    assert text.startswith('Answer: "') and '"\nAnswer: "' in text, text
    ends = [len(decode(out[:i + 1])) for i in range(len(out))]  # each token's end offset

    starts = [0] + ends[:-1]
    second = text.index('\nAnswer: "')  # the newline is dictated too: the quote closed the word
    fixed = [(0, 9), (second, second + 10)]  # the literals that follow no choice

    def is_fixed(i: int) -> bool:
        return any(lo <= starts[i] < ends[i] <= hi for lo, hi in fixed)

    assert req.window_token_ids == [t for i, t in enumerate(out) if not is_fixed(i)]
    heads = [[t for i, t in enumerate(out) if is_fixed(i) and starts[i] >= lo and ends[i] <= hi]
             for lo, hi in fixed]
    assert heads[0] and heads[0] == heads[1][1:]  # spelt alike: the first did not penalise it
