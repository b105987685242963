"""The sticky sampling settings store: contract.md's "Sticky settings" and "Validation" rows."""

import logging
from dataclasses import fields

import pytest

from kiln.api.errors import error_body, http_status
from kiln.api.protocol.chat import parse_chat_request
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.sampling.params import SamplingParams
from kiln.runtime.sampling.settings import STICKY_FIELDS, SamplingFields, SamplingSettings
from kiln.runtime.store.catalogue import CATALOGUE, SamplingDefaults

SMOL = CATALOGUE["smollm2:135m"].defaults  # temperature 0.2, top_p 0.9, top_k 40, ...
WITH_PRESENCE = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0,
                                 presence_penalty=1.5, frequency_penalty=0.0,
                                 repetition_penalty=1.0)


@pytest.fixture
def settings():
    return SamplingSettings(SMOL)


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "kiln" and r.levelno == logging.WARNING]


def test_every_request_field_is_sticky_or_seed():
    assert {f.name for f in fields(SamplingFields)} == set(STICKY_FIELDS) | {"seed"}


def test_a_request_that_sends_nothing_gets_the_model_defaults(settings):
    p = settings.admit(SamplingFields())
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.2, 0.9, 40, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.1)
    assert p.repeat_last_n == 64 and p.seed is None
    assert isinstance(p, SamplingParams)


def test_gemma_defaults_come_from_its_catalogue_entry():
    p = SamplingSettings(CATALOGUE["gemma3:270m"].defaults).admit(SamplingFields())
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 0.95, 64, 0.0)


# --- stickiness ---

def test_temperature_zero_sticks_for_the_next_request_that_sends_nothing(settings):
    a = settings.admit(SamplingFields(temperature=0))
    b = settings.admit(SamplingFields())
    assert a.temperature == 0.0 and a.is_greedy
    assert b.temperature == 0.0 and b.is_greedy
    assert isinstance(b.temperature, float)


def test_a_request_uses_its_own_values_and_the_stored_ones_for_the_rest(settings):
    settings.admit(SamplingFields(top_p=0.5, top_k=7))
    p = settings.admit(SamplingFields(temperature=0.9))
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.9, 0.5, 7, 0.1)


def test_reset_restores_the_defaults(settings):
    settings.admit(SamplingFields(temperature=0, top_k=1, repeat_last_n=-1, think=True,
                                  reasoning_effort="high", presence_penalty=1.0))
    settings.reset()
    assert settings.admit(SamplingFields()) == settings.defaults
    assert settings.current.temperature == 0.2


def test_presence_penalty_zero_turns_a_nonzero_default_off_for_later_requests():
    s = SamplingSettings(WITH_PRESENCE)
    assert s.admit(SamplingFields()).presence_penalty == 1.5
    assert s.admit(SamplingFields(presence_penalty=0)).presence_penalty == 0.0
    assert s.admit(SamplingFields()).presence_penalty == 0.0
    s.reset()
    assert s.admit(SamplingFields()).presence_penalty == 1.5


def test_per_request_mode_sticks_nothing():
    s = SamplingSettings(WITH_PRESENCE, per_request=True)
    a = s.admit(SamplingFields(temperature=0, presence_penalty=0, think=False,
                               repeat_last_n=-1))
    b = s.admit(SamplingFields())
    assert (a.temperature, a.presence_penalty, a.think, a.repeat_last_n) == (0.0, 0.0, False, -1)
    assert (b.temperature, b.presence_penalty, b.think, b.repeat_last_n) == (0.7, 1.5, None, 64)


def test_per_request_mode_keeps_the_default_for_an_out_of_range_value(caplog):
    s = SamplingSettings(WITH_PRESENCE, per_request=True)
    s.admit(SamplingFields(temperature=0.1))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert s.admit(SamplingFields(temperature=-1)).temperature == 0.7


def test_seed_applies_to_its_own_request_only(settings):
    assert settings.admit(SamplingFields(seed=42, temperature=0.8)).seed == 42
    after = settings.admit(SamplingFields())
    assert after.seed is None and after.temperature == 0.8
    assert settings.current.seed is None


def test_think_and_reasoning_effort_stick_like_sampling_fields(settings):
    settings.admit(SamplingFields(think=False, reasoning_effort="low"))
    p = settings.admit(SamplingFields(temperature=0.3))
    assert (p.think, p.reasoning_effort) == (False, "low")


def test_a_snapshot_does_not_change_when_a_later_request_changes_the_store(settings):
    first = settings.admit(SamplingFields(temperature=0.5))
    settings.admit(SamplingFields(temperature=1.5, top_k=3))
    assert (first.temperature, first.top_k) == (0.5, 40)


# --- validation: out of range -> HTTP 200, a warning naming field and value, value kept ---

OUT_OF_RANGE = [
    ("temperature", -0.5),
    ("temperature", float("nan")),
    ("top_p", 0),
    ("top_p", -0.1),
    ("top_p", 1.01),
    ("top_k", 0),
    ("top_k", -1),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("presence_penalty", -0.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2),
    ("frequency_penalty", 2.01),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.1),
    ("reasoning_effort", "extreme"),
]


@pytest.mark.parametrize("name,value", OUT_OF_RANGE)
def test_an_out_of_range_value_is_ignored_with_a_warning_and_the_stored_value_kept(
        settings, caplog, name, value):
    settings.admit(SamplingFields(temperature=0.6))  # a stored, non-default value
    before = settings.current
    with caplog.at_level(logging.WARNING, logger="kiln"):
        p = settings.admit(SamplingFields(**{name: value}))
    assert getattr(p, name) == getattr(before, name)
    assert settings.current == before
    (msg,) = warnings_of(caplog)
    assert msg.startswith(f"[kiln]  Ignoring {name}={value!r} (")
    assert f"keeping {getattr(before, name)!r}" in msg


def test_an_out_of_range_value_does_not_stop_the_valid_fields_of_the_same_request(settings):
    p = settings.admit(SamplingFields(temperature=-1, top_p=0.5))
    assert (p.temperature, p.top_p) == (0.2, 0.5)
    assert settings.current.top_p == 0.5


def test_boundary_values_are_accepted(settings, caplog):
    with caplog.at_level(logging.WARNING, logger="kiln"):
        p = settings.admit(SamplingFields(temperature=0, top_p=1, top_k=1, min_p=0,
                                          presence_penalty=2, frequency_penalty=0))
        q = settings.admit(SamplingFields(min_p=1, presence_penalty=0, frequency_penalty=2))
    assert warnings_of(caplog) == []
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty) == (0, 1, 1, 0, 2)
    assert (q.min_p, q.frequency_penalty) == (1.0, 2.0)


def test_a_huge_integer_temperature_is_out_of_range_not_a_crash(settings, caplog):
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert settings.admit(SamplingFields(temperature=10**400)).temperature == 0.2
    assert len(warnings_of(caplog)) == 1


def test_repetition_penalty_below_one_is_accepted_with_a_loop_warning(settings, caplog):
    with caplog.at_level(logging.WARNING, logger="kiln"):
        p = settings.admit(SamplingFields(repetition_penalty=0.8))
    assert p.repetition_penalty == 0.8 and settings.current.repetition_penalty == 0.8
    (msg,) = warnings_of(caplog)
    assert msg == ("[kiln]  repetition_penalty=0.8 is below 1: it rewards repeats and can "
                   "make the model loop")


def test_repetition_penalty_of_one_or_more_gives_no_warning(settings, caplog):
    with caplog.at_level(logging.WARNING, logger="kiln"):
        settings.admit(SamplingFields(repetition_penalty=1))
        settings.admit(SamplingFields(repetition_penalty=1.3))
    assert warnings_of(caplog) == []


# --- validation: type errors -> 400 naming the field ---

@pytest.mark.parametrize("name,value", [
    ("temperature", "hot"), ("temperature", True), ("top_p", [0.5]), ("min_p", {}),
    ("presence_penalty", "0"), ("frequency_penalty", False), ("repetition_penalty", "1.1"),
    ("top_k", 1.5), ("top_k", True), ("top_k", "40"),
    ("repeat_last_n", 64.5), ("repeat_last_n", "64"), ("repeat_last_n", False),
    ("seed", True), ("seed", 1.5), ("seed", "42"),
    ("think", "yes"), ("think", 1), ("reasoning_effort", 3),
])
def test_a_field_of_the_wrong_type_is_a_400_naming_it(name, value):
    """Read from the request's JSON (api/protocol.py), where the types are checked."""
    with pytest.raises(InvalidRequestError) as e:
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], name: value})
    assert e.value.param == name and http_status(e.value) == 400
    assert error_body(e.value)["error"] == {
        "message": e.value.message, "type": "invalid_request_error", "param": name,
        "code": "invalid_type"}


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_a_seed_outside_signed_64_bit_is_a_400(seed):
    with pytest.raises(InvalidRequestError) as e:
        SamplingFields(seed=seed)
    assert e.value.param == "seed"


@pytest.mark.parametrize("seed", [0, -1, 2**63 - 1, -(2**63)])
def test_any_signed_64_bit_seed_is_accepted(settings, seed):
    assert settings.admit(SamplingFields(seed=seed)).seed == seed


@pytest.mark.parametrize("n", [-2, -64])
def test_repeat_last_n_below_minus_one_is_a_400(n):
    with pytest.raises(InvalidRequestError) as e:
        SamplingFields(repeat_last_n=n)
    assert e.value.param == "repeat_last_n"


@pytest.mark.parametrize("n", [-1, 0, 1, 4096])
def test_repeat_last_n_minus_one_and_up_is_accepted_and_sticks(settings, n):
    settings.admit(SamplingFields(repeat_last_n=n))
    assert settings.admit(SamplingFields()).repeat_last_n == n


def test_sampling_params_refuses_values_the_engine_cannot_run():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(seed=2**63)
