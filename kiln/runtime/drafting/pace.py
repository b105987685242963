"""How much one request drafts: drafts that are accepted whole grow the next one (up to the
configured k), a partly accepted draft sets it to what was accepted plus one, and drafts that
keep missing pause drafting for a while (doubling, up to 64 steps), so text the request's
context does not foretell costs next to nothing. A function of the request's own history only:
what it drafts does not depend on what else is in the batch."""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE = 64  # steps


@dataclass(slots=True)
class DraftPace:
    limit: int  # the configured k
    length: int = 0  # the next draft's most tokens (set to limit when built)
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # steps left without drafting
    position: int = -1  # the sequence's length when it was last asked (once per position)

    def __post_init__(self) -> None:
        self.length = self.length or self.limit

    def next_length(self) -> int:
        """The most tokens to draft at this position (0: not now)."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.length

    def record(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        if accepted == 0:
            self.misses += 1
            self.length = 1
            if self.misses >= 2:
                self.pause = min(MAX_PAUSE, 2 ** self.misses)
        else:
            self.misses = 0
            self.length = min(self.limit, self.length + 1 if accepted == drafted
                              else accepted + 1)
