"""When one request drafts: three verifications in a row that keep nothing pause its drafting
(for 2, 4, ... 64 steps as the misses go on), and a kept token ends the pause streak, so text
its context does not foretell costs next to nothing. How long a draft is follows the match
that proposed it (ngram.py), not the request's history: shortening the draft after a partial
acceptance as well cost more kept tokens than rows it saved in the bench's replays
(bench/README.md, run Q). A function of the request's own history only: what it drafts does
not depend on what else is in the batch."""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE = 64  # steps
MISSES = 3  # verifications in a row that keep nothing before a pause


@dataclass(slots=True)
class DraftPace:
    limit: int  # the configured k
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # steps left without drafting
    position: int = -1  # the sequence's length when it was last asked (once per position)

    def next_length(self) -> int:
        """The most tokens to draft at this position (0: not now)."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.limit

    def record(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= MISSES:
            self.pause = min(MAX_PAUSE, 2 ** (self.misses - MISSES + 1))
