"""The loaded model's sticky sampling settings: the one global-ish object the contract allows.

A request sends some sampling fields (`SamplingFields`, read by api/protocol).
`SamplingSettings.admit` merges its valid values over the stored ones, stores them for later
requests (from any client) and returns a frozen `SamplingParams` snapshot, so a request never
sees a setting change mid-reply. `reset()` (model reload) restores the model's defaults.

Rules (contract.md, "Sticky settings" and "Validation"):
- a wrong JSON type is a 400 raised by api/protocol; a seed outside signed 64-bit or a
  repeat_last_n below -1 is a 400 raised when `SamplingFields` is built;
- an out-of-range value is ignored: HTTP 200, one warning on the `kiln` logger naming the
  field and the value, and the stored value is used and kept;
- repetition_penalty in (0, 1) is accepted, with a warning that it can make the model loop;
- seed is never stored; think and reasoning_effort stick like the sampling fields;
- with `per_request=True` (`kiln serve --per-request-sampling`) nothing sticks: every
  request starts from the defaults.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
from collections.abc import Callable
from dataclasses import InitVar, dataclass, replace

from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.sampling.params import INT64_MAX, INT64_MIN, REASONING_EFFORTS, SamplingParams
from kiln.runtime.store.catalogue import SamplingDefaults

logger = logging.getLogger("kiln")

FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty")
INT_FIELDS = ("top_k", "repeat_last_n", "seed")
STICKY_FIELDS = FLOAT_FIELDS + ("top_k", "repeat_last_n", "think", "reasoning_effort")

# field -> (accepts the value, the rule as the warning states it)
RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "temperature": (lambda v: v >= 0, "must be >= 0"),
    "top_p": (lambda v: 0 < v <= 1, "must be > 0 and <= 1"),
    "top_k": (lambda v: v >= 1, "must be >= 1"),
    "min_p": (lambda v: 0 <= v <= 1, "must be >= 0 and <= 1"),
    "presence_penalty": (lambda v: 0 <= v <= 2, "must be >= 0 and <= 2"),
    "frequency_penalty": (lambda v: 0 <= v <= 2, "must be >= 0 and <= 2"),
    "repetition_penalty": (lambda v: v > 0, "must be > 0"),
}


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """The sampling fields one request sent; None = not sent. Types are checked here."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    repeat_last_n: int | None = None
    seed: int | None = None
    think: bool | None = None
    reasoning_effort: str | None = None
    # Where the client wrote these fields, for a 400's param (Ollama's: "options.").
    param_prefix: InitVar[str] = ""

    def __post_init__(self, param_prefix: str) -> None:
        # Types are api/protocol's business (it reads the JSON); these are the contract's
        # rules for well-typed values.
        if self.repeat_last_n is not None and self.repeat_last_n < -1:
            param = param_prefix + "repeat_last_n"
            raise InvalidRequestError(
                f"Invalid '{param}': {self.repeat_last_n}. Expected -1 (the whole "
                "reply), 0 (penalties off) or a positive window size.",
                param=param, code="integer_below_min_value")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            param = param_prefix + "seed"
            raise InvalidRequestError(
                f"Invalid '{param}': {self.seed} is outside the signed 64-bit range.",
                param=param, code="integer_out_of_range")


def params_from_defaults(defaults: SamplingDefaults) -> SamplingParams:
    return SamplingParams(
        temperature=float(defaults.temperature), top_p=float(defaults.top_p),
        top_k=int(defaults.top_k), min_p=float(defaults.min_p),
        presence_penalty=float(defaults.presence_penalty),
        frequency_penalty=float(defaults.frequency_penalty),
        repetition_penalty=float(defaults.repetition_penalty),
        repeat_last_n=int(defaults.repeat_last_n),
    )


def _f32(value: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _accepted(name: str, value: object, kept: object) -> bool:
    """Whether a type-checked value is in range; warns (stable wording) when it is not."""
    if name == "reasoning_effort":
        ok, rule = value in REASONING_EFFORTS, "must be one of " + ", ".join(REASONING_EFFORTS)
    elif name in RANGES:
        in_range, rule = RANGES[name]
        # The sampler runs in float32: a value that overflows or underflows there is out of
        # range too (1e300 -> inf, repetition_penalty 1e-300 -> 0).
        ok = (name not in FLOAT_FIELDS or (_finite(value) and _finite(_f32(value))
                                            and in_range(_f32(value)))) and in_range(value)
    else:
        return True
    if not ok:
        logger.warning("[kiln]  Ignoring %s=%r (%s): keeping %r", name, value, rule, kept)
        return False
    if name == "repetition_penalty" and value < 1:
        logger.warning("[kiln]  repetition_penalty=%r is below 1: it rewards repeats and can "
                       "make the model loop", value)
    return True


class SamplingSettings:
    """The loaded model's stored sampling values, and the door every request goes through."""

    def __init__(self, defaults: SamplingDefaults, *, per_request: bool = False) -> None:
        self.per_request = per_request
        self._defaults = params_from_defaults(defaults)
        self._stored = self._defaults
        self._lock = threading.Lock()

    @property
    def defaults(self) -> SamplingParams:
        return self._defaults

    @property
    def current(self) -> SamplingParams:
        """What a request that sends no sampling fields would get now (seed None)."""
        return self._stored

    def admit(self, sent: SamplingFields) -> SamplingParams:
        """The request's frozen snapshot; its valid values become the stored ones."""
        with self._lock:
            base = self._defaults if self.per_request else self._stored
            updates: dict[str, object] = {}
            for name in STICKY_FIELDS:
                value = getattr(sent, name)
                if value is None or not _accepted(name, value, getattr(base, name)):
                    continue
                updates[name] = float(value) if name in FLOAT_FIELDS else value
            stored = replace(base, **updates) if updates else base
            if not self.per_request:
                self._stored = stored
        return replace(stored, seed=sent.seed) if sent.seed is not None else stored

    def reset(self) -> None:
        """Model reload: back to the model's defaults."""
        with self._lock:
            self._stored = self._defaults

