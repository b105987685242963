"""reasoning_content vs content: the streaming splitter on scripted delta streams."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln.runtime.text.reasoning import (
    THINK_TAGS,
    ReasoningDelta,
    ReasoningParser,
    ReasoningStart,
    split_reasoning,
)

OUTSIDE, INSIDE, UNDECIDED = ReasoningStart.OUTSIDE, ReasoningStart.INSIDE, ReasoningStart.UNDECIDED


def stream(deltas, start=OUTSIDE, tags=THINK_TAGS):
    """Every (reasoning, content) pair the parser emits, finish() included, empties dropped."""
    p = ReasoningParser(tags, start)
    out = [p.feed(d) for d in deltas] + [p.finish()]
    return [d for d in out if d.reasoning or d.content]


def joined(deltas, start=OUTSIDE, tags=THINK_TAGS):
    pairs = stream(deltas, start, tags)
    return ("".join(d.reasoning for d in pairs) or None,
            "".join(d.content for d in pairs) or None)


def test_reasoning_then_answer_tags_removed():
    text = "<think>Two and two.</think>\n\nThe answer is 4."
    assert split_reasoning(text, THINK_TAGS) == ("Two and two.", "The answer is 4.")


def test_tags_split_across_deltas():
    deltas = ["<th", "ink>Hm", "m, ok.</", "thi", "nk>", "\n", "\nFour", "."]
    assert stream(deltas) == [ReasoningDelta("Hm", ""), ReasoningDelta("m, ok.", ""),
                              ReasoningDelta("", "Four"), ReasoningDelta("", ".")]


def test_reasoning_deltas_come_before_content_deltas():
    pairs = stream(["<think>", "a", "b", "</think>", "c", "d"])
    kinds = ["r" if d.reasoning else "c" for d in pairs]
    assert kinds == ["r", "r", "c", "c"]


def test_no_closing_tag_means_everything_after_the_opening_tag_is_reasoning():
    assert joined(["<think>still ", "going"]) == ("still going", None)
    assert split_reasoning("<think>still going", THINK_TAGS) == ("still going", None)


def test_a_partial_closing_tag_at_the_end_is_flushed_as_reasoning():
    assert stream(["<think>x</thi"]) == [ReasoningDelta("x", ""), ReasoningDelta("</thi", "")]


def test_text_before_the_opening_tag_is_content():
    assert split_reasoning("Sure. <think>plan</think>Done.", THINK_TAGS) == ("plan",
                                                                              "Sure. Done.")


def test_whitespace_before_the_opening_tag_is_dropped():
    assert split_reasoning("\n <think>plan</think>Done.", THINK_TAGS) == ("plan", "Done.")


def test_the_whitespace_after_the_closing_tag_is_dropped_but_later_whitespace_kept():
    assert split_reasoning("<think>r</think>\n\n  A\n\nB ", THINK_TAGS) == ("r", "A\n\nB ")


def test_reasoning_whitespace_is_kept_as_written():
    assert split_reasoning("<think>\nstep 1\n</think>x", THINK_TAGS) == ("\nstep 1\n", "x")


def test_an_empty_or_blank_think_block_means_no_reasoning():
    assert split_reasoning("<think>\n\n</think>\n\nHello", THINK_TAGS) == (None, "Hello")
    assert split_reasoning("<think></think>Hello", THINK_TAGS) == (None, "Hello")
    assert stream(["<think>", "\n", "\n", "</think>", "\n\nHi"]) == [ReasoningDelta("", "Hi")]


def test_a_reply_without_tags_is_all_content_whitespace_kept():
    assert split_reasoning(" Yes", THINK_TAGS) == (None, " Yes")
    assert split_reasoning("a < b and c > d", THINK_TAGS) == (None, "a < b and c > d")


def test_a_whitespace_only_reply_is_content_flushed_at_the_end():
    assert stream([" ", "\n"]) == [ReasoningDelta("", " \n")]


def test_a_partial_opening_tag_is_held_until_proven_not_a_tag():
    p = ReasoningParser(THINK_TAGS)
    assert p.feed("a <thi") == ReasoningDelta("", "a ")
    assert p.feed("s") == ReasoningDelta("", "<this")
    assert p.feed(" <") == ReasoningDelta("", " ")
    assert p.finish() == ReasoningDelta("", "<")


def test_tags_after_the_closing_tag_are_plain_content():
    assert split_reasoning("<think>a</think>b<think>c</think>", THINK_TAGS) == (
        "a", "b<think>c</think>")


def test_inside_the_reply_starts_as_reasoning():
    assert joined(["Let me see", ".</think>\n\nFour."], INSIDE) == ("Let me see.", "Four.")
    assert split_reasoning("never closed", THINK_TAGS, INSIDE) == ("never closed", None)


def test_undecided_holds_everything_until_the_closing_tag():
    p = ReasoningParser(THINK_TAGS, UNDECIDED)
    assert p.feed(" is sunny") == ReasoningDelta("", "")
    assert p.feed(" today.</thi") == ReasoningDelta("", "")
    assert p.feed("nk>\n\nYes.") == ReasoningDelta(" is sunny today.", "Yes.")
    assert p.finish() == ReasoningDelta("", "")


def test_undecided_without_a_closing_tag_is_content_as_written():
    p = ReasoningParser(THINK_TAGS, UNDECIDED)
    assert p.feed(" Yes") == ReasoningDelta("", "")
    assert p.feed(" ") == ReasoningDelta("", "")
    assert p.finish() == ReasoningDelta("", " Yes ")


def test_undecided_that_opens_its_own_block_keeps_the_text_before_as_content():
    assert split_reasoning(" Yes.<think>why</think>Because.", THINK_TAGS, UNDECIDED) == (
        "why", " Yes.Because.")


def test_another_tag_pair_works_the_same_way():
    tags = ("<thought>", "</thought>")
    assert joined(["<tho", "ught>x</though", "t>y"], tags=tags) == ("x", "y")
    assert split_reasoning("<think>x</think>y", tags) == (None, "<think>x</think>y")


def test_start_for_prompt():
    open_think = "<|im_start|>assistant\n<think>\n"
    closed = "<|im_start|>assistant\n<think>a</think>b<|im_end|>\n<|im_start|>assistant\n"
    assert ReasoningStart.for_prompt(open_think, THINK_TAGS) is INSIDE
    assert ReasoningStart.for_prompt(closed, THINK_TAGS) is OUTSIDE
    assert ReasoningStart.for_prompt(closed + "The answer is:", THINK_TAGS, continuing=True,
                                     reasons_first=True) is UNDECIDED
    assert ReasoningStart.for_prompt(closed + "The answer is:", THINK_TAGS,
                                     continuing=True) is OUTSIDE


SCRIPTED = [
    "<think>Two and two.</think>\n\nThe answer is 4.",
    "Sure. <think>plan</think>Done.",
    "\n <think>\n\n</think>\n\nHello <b>x</b>",
    "<think>a < b, </thin k> </think",
    " Yes",
    "  \n",
    "x</think>y<think>z",
]


@pytest.mark.parametrize("start", [OUTSIDE, INSIDE, UNDECIDED])
@pytest.mark.parametrize("text", SCRIPTED)
def test_single_character_deltas_equal_the_one_shot_result(text, start):
    assert joined(list(text), start) == split_reasoning(text, THINK_TAGS, start)


PIECES = st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "think", ">", "<",
                          " ", "\n", "a", "b c", "<thinker>", "</thin"])


@given(pieces=st.lists(PIECES, max_size=12), cuts=st.lists(st.integers(0, 80), max_size=8),
       start=st.sampled_from([OUTSIDE, INSIDE, UNDECIDED]))
def test_any_cut_into_deltas_gives_the_one_shot_result(pieces, cuts, start):
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts})
    deltas = [text[i:j] for i, j in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    assert joined(deltas, start) == split_reasoning(text, THINK_TAGS, start)


def reference_split(text, start=OUTSIDE, tags=THINK_TAGS):
    """The rules of api/reasoning.py written out on the whole text."""
    open_tag, close_tag = tags
    if start is UNDECIDED:
        i_open, i_close = text.find(open_tag), text.find(close_tag)
        if i_close < 0 and i_open < 0:
            return None, text or None
        start = INSIDE if i_close >= 0 and (i_open < 0 or i_close < i_open) else OUTSIDE
    before, rest = "", text
    if start is OUTSIDE:
        i = text.find(open_tag)
        if i < 0:
            return None, text or None
        before, rest = text[:i], text[i + len(open_tag):]
        before = before if before.strip() else ""
    reasoning, _, after = rest.partition(close_tag)
    reasoning = reasoning if reasoning.strip() else ""
    return reasoning or None, (before + after.lstrip()) or None


@given(pieces=st.lists(PIECES, max_size=12),
       start=st.sampled_from([OUTSIDE, INSIDE, UNDECIDED]))
def test_the_parser_matches_the_rules_written_on_the_whole_text(pieces, start):
    text = "".join(pieces)
    assert split_reasoning(text, THINK_TAGS, start) == reference_split(text, start)
