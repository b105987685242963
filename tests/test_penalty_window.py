"""The penalty window: the last repeat_last_n generated tokens, per contract.md."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln.runtime.sampling.params import SamplingParams
from kiln.runtime.sampling.penalty_window import window_tokens


def grow(n, tokens, carried=()):
    """The window after each generated token, as the sampler sees it step by step."""
    return [window_tokens(n, tokens[:i + 1], carried) for i in range(len(tokens))]


def test_the_window_slides_over_the_last_n_generated_tokens():
    assert grow(3, [1, 2, 3, 4, 5]) == [[1], [1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]


def test_repeats_stay_in_the_window_until_they_slide_out():
    assert window_tokens(4, [5, 5, 6, 5, 6]) == [5, 6, 5, 6]
    assert window_tokens(2, [7, 7, 8, 9]) == [8, 9]


def test_default_window_is_64_tokens():
    assert window_tokens(SamplingParams().repeat_last_n, list(range(100))) == \
        list(range(36, 100))


def test_minus_one_covers_the_whole_reply():
    assert window_tokens(-1, list(range(1000))) == list(range(1000))


def test_zero_turns_the_window_off():
    assert window_tokens(0, [4, 5, 6], [1, 2, 3]) == []


def test_the_window_starts_with_the_tail_of_a_cached_earlier_reply():
    carried = [10, 11, 12, 13, 14, 15]
    assert window_tokens(4, [], carried) == [12, 13, 14, 15]
    assert grow(4, [1, 2, 3, 4], carried) == [[13, 14, 15, 1], [14, 15, 1, 2],
                                              [15, 1, 2, 3], [1, 2, 3, 4]]


def test_a_smaller_window_applies_from_the_requests_first_token():
    # The earlier reply ran with the default 64; this request sends repeat_last_n=2.
    earlier = list(range(100, 164))
    assert window_tokens(2, [], earlier) == [162, 163]
    assert window_tokens(2, [1], earlier) == [163, 1]


def test_minus_one_with_a_carried_reply_keeps_all_of_it():
    assert window_tokens(-1, [], [1, 2]) == [1, 2]
    assert window_tokens(-1, [3], [1, 2]) == [1, 2, 3]


def test_repeat_last_n_below_minus_one_is_refused():
    with pytest.raises(ValueError):
        window_tokens(-2, [1])


@given(n=st.integers(1, 12), carried=st.lists(st.integers(0, 5), max_size=20),
       generated=st.lists(st.integers(0, 5), max_size=40))
def test_the_window_is_the_last_n_of_carried_then_generated(n, carried, generated):
    assert window_tokens(n, generated, carried) == (carried + generated)[-n:]
