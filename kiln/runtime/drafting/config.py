"""How a server drafts (`kiln serve --speculative ngram`), checked where it is built."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram",)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # the most tokens drafted for one step (k)
    ngram_min: int = 3  # prompt lookup: the shortest suffix matched, in tokens
    ngram_max: int = 4  # the longest, tried first

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative {self.method!r}: kiln drafts with "
                             f"{', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"--num-speculative-tokens {self.num_speculative_tokens} must be "
                             "from 1 to 16")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"--ngram-min {self.ngram_min} and --ngram-max {self.ngram_max}: "
                             "need 1 <= min <= max")
