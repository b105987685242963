"""One request's effective sampling values, frozen when the request is admitted.

Built by `SamplingSettings.admit` (runtime/sampling/settings.py), which has already applied
the contract's rules (out-of-range request values ignored, sticky values filled in). The
checks below only guard the engine against values it cannot run with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64  # -1 = whole reply, 0 = penalties off
    seed: int | None = None  # never sticky: only the request that sent it
    think: bool | None = None  # None = the template's own default
    reasoning_effort: str | None = None
    # Read for every row of every step (Sampler.columns), so worked out once here:
    # the sampler's columns (temperature, top_k, top_p, min_p, then the three penalties),
    # whether the row is argmax and whether its penalties do anything.
    columns: tuple[float, ...] = field(init=False, repr=False, compare=False)
    is_greedy: bool = field(init=False, repr=False, compare=False)
    has_penalties: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature {self.temperature} must be finite and >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} must be >= 0 (0 = off)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p {self.min_p} must be in [0, 1]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty {self.repetition_penalty} must be > 0")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n {self.repeat_last_n} must be >= -1")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise ValueError(f"seed {self.seed} is outside signed 64-bit")
        object.__setattr__(self, "columns", (
            self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty,
            self.frequency_penalty, self.presence_penalty))
        # The contract: temperature 0 or top_k 1 is argmax and draws no random number.
        object.__setattr__(self, "is_greedy", self.temperature == 0.0 or self.top_k == 1)
        object.__setattr__(self, "has_penalties", self.repeat_last_n != 0 and (
            self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0))
