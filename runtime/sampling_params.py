"""One request's effective sampling values, frozen when the request is admitted."""

from __future__ import annotations

from dataclasses import dataclass


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
    seed: int | None = None
    think: bool | None = None
    reasoning_effort: str | None = None

    @property
    def is_greedy(self) -> bool:
        # The contract: temperature 0 or top_k 1 is argmax and draws no random number.
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )
