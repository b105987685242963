"""The penalty window: the last repeat_last_n generated tokens, per contract.md."""

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.penalty_window import PenaltyWindow, window_tokens
from runtime.sampling_params import SamplingParams


def grow(window: PenaltyWindow, tokens):
    """The window after each generated token, as the engine sees it step by step."""
    seen = []
    for t in tokens:
        window.append(t)
        seen.append(window.tokens())
    return seen


def test_the_window_slides_over_the_last_n_generated_tokens():
    w = PenaltyWindow(3)
    assert grow(w, [1, 2, 3, 4, 5]) == [[1], [1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]
    assert dict(w.counts) == {3: 1, 4: 1, 5: 1}


def test_a_token_that_falls_out_of_the_window_is_no_longer_counted():
    w = PenaltyWindow(2)
    w.extend([7, 7, 8, 9])
    assert 7 not in w.counts and dict(w.counts) == {8: 1, 9: 1}


def test_counts_count_repeats_inside_the_window():
    w = PenaltyWindow(4)
    w.extend([5, 5, 6, 5, 6])
    assert w.tokens() == [5, 6, 5, 6] and dict(w.counts) == {5: 2, 6: 2}


def test_default_window_is_64_tokens():
    w = PenaltyWindow.for_request(SamplingParams())
    w.extend(range(100))
    assert w.tokens() == list(range(36, 100)) and len(w) == 64


def test_minus_one_covers_the_whole_reply():
    w = PenaltyWindow(-1)
    w.extend(range(1000))
    assert len(w) == 1000 and w.tokens()[0] == 0
    assert window_tokens(-1, list(range(1000))) == list(range(1000))


def test_zero_turns_the_window_off():
    w = PenaltyWindow(0, carried=[1, 2, 3])
    w.extend([4, 5, 6])
    assert w.tokens() == [] and dict(w.counts) == {}
    assert window_tokens(0, [4, 5, 6], [1, 2, 3]) == []


def test_the_window_starts_with_the_tail_of_a_cached_earlier_reply():
    w = PenaltyWindow(4, carried=[10, 11, 12, 13, 14, 15])
    assert w.tokens() == [12, 13, 14, 15]
    assert grow(w, [1, 2]) == [[13, 14, 15, 1], [14, 15, 1, 2]]
    w.extend([3, 4])
    assert w.tokens() == [1, 2, 3, 4]  # the carried tail has slid out


def test_a_smaller_window_applies_from_the_requests_first_token():
    # The earlier reply ran with the default 64; this request sends repeat_last_n=2.
    earlier = list(range(100, 164))
    w = PenaltyWindow.for_request(SamplingParams(repeat_last_n=2), carried=earlier)
    assert w.tokens() == [162, 163]
    assert window_tokens(2, [], earlier) == [162, 163]
    w.append(1)
    assert w.tokens() == [163, 1]


def test_minus_one_with_a_carried_reply_keeps_all_of_it():
    assert PenaltyWindow(-1, carried=[1, 2]).tokens() == [1, 2]
    assert window_tokens(-1, [3], [1, 2]) == [1, 2, 3]


def test_a_seeded_request_starts_with_an_empty_window():
    w = PenaltyWindow.for_request(SamplingParams(seed=42), carried=[1, 2, 3])
    assert w.tokens() == []
    w.append(9)
    assert w.tokens() == [9]


def test_an_unseeded_request_keeps_the_carried_tail():
    assert PenaltyWindow.for_request(SamplingParams(), carried=[1, 2, 3]).tokens() == [1, 2, 3]


def test_repeat_last_n_below_minus_one_is_refused():
    with pytest.raises(ValueError):
        PenaltyWindow(-2)
    with pytest.raises(ValueError):
        window_tokens(-2, [1])


@given(n=st.integers(-1, 12), carried=st.lists(st.integers(0, 5), max_size=20),
       generated=st.lists(st.integers(0, 5), max_size=40))
def test_incremental_window_matches_the_definition_at_every_step(n, carried, generated):
    w = PenaltyWindow(n, carried)
    assert w.tokens() == window_tokens(n, [], carried)
    for i, t in enumerate(generated):
        w.append(t)
        expected = window_tokens(n, generated[:i + 1], carried)
        assert w.tokens() == expected
        assert dict(w.counts) == dict(Counter(expected))
