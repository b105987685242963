"""How a server drafts (`kiln serve --speculative ngram`), checked where it is built."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram",)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 8  # the most tokens drafted for one step (k)
    ngram_min: int = 2  # prompt lookup: the shortest suffix matched, in tokens
    ngram_max: int = 8  # the longest, tried first; a draft is at most as long as its match
    # A request whose reply drafting cannot change (greedy without penalties) drafts only
    # while at most this many requests run: past it a step is bound by compute, where a kept
    # draft saves a step but no work and a rejected one is work lost. Other requests draft
    # by their own pace whatever the load (their replies must not follow the batch). vLLM's
    # --speculative-disable-by-batch-size. None: the device's (EngineConfig); 0: no limit.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative {self.method!r}: kiln drafts with "
                             f"{', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"--num-speculative-tokens {self.num_speculative_tokens} must be "
                             "from 1 to 16")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 0:
            raise ValueError(f"--speculative-disable-by-batch-size {self.disable_by_batch_size} "
                             "must be >= 0")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"--ngram-min {self.ngram_min} and --ngram-max {self.ngram_max}: "
                             "need 1 <= min <= max")
