"""The penalty window: which generated tokens presence/frequency/repetition penalties see.

Contract: the last `repeat_last_n` generated tokens (default 64; -1 = the whole reply;
0 = penalties off). The prompt never counts; reasoning tokens do. A request that continues a
conversation still held in the cache starts with the tail of the earlier reply (`carried`);
a request with a seed always starts empty. The window size is the request's own snapshot, so
a smaller window applies from the request's first token: the carried tail is cut to it.

`window_tokens` is the plain definition (the tests' oracle). `PenaltyWindow` is what the engine
keeps per sequence: it updates token counts in O(1) per decode step instead of recounting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from runtime.sampling_params import SamplingParams


def window_tokens(repeat_last_n: int, generated: Sequence[int],
                  carried: Sequence[int] = ()) -> list[int]:
    """The window's token ids, oldest first: the last repeat_last_n of carried + generated."""
    if repeat_last_n == 0:
        return []
    if repeat_last_n == -1:
        return [*carried, *generated]
    if repeat_last_n < -1:
        raise ValueError(f"repeat_last_n {repeat_last_n} must be >= -1")
    own = list(generated[-repeat_last_n:])
    need = repeat_last_n - len(own)
    return (list(carried[-need:]) if need > 0 else []) + own


class PenaltyWindow:
    """One sequence's sliding window with per-token counts, kept incrementally."""

    __slots__ = ("size", "_tokens", "_counts")

    def __init__(self, repeat_last_n: int, carried: Sequence[int] = ()) -> None:
        if repeat_last_n < -1:
            raise ValueError(f"repeat_last_n {repeat_last_n} must be >= -1")
        self.size = repeat_last_n
        self._tokens: deque[int] = deque()
        self._counts: dict[int, int] = {}
        if repeat_last_n == -1:
            self.extend(carried)
        elif repeat_last_n > 0:
            self.extend(carried[-repeat_last_n:])

    @classmethod
    def for_request(cls, params: SamplingParams, carried: Sequence[int] = ()) -> PenaltyWindow:
        """A request's window: the carried reply tail, unless the request sent a seed."""
        return cls(params.repeat_last_n, () if params.seed is not None else carried)

    def append(self, token_id: int) -> None:
        """Record one generated token; the oldest falls out once the window is full."""
        if self.size == 0:
            return
        self._tokens.append(token_id)
        self._counts[token_id] = self._counts.get(token_id, 0) + 1
        if 0 < self.size < len(self._tokens):
            old = self._tokens.popleft()
            left = self._counts[old] - 1
            if left:
                self._counts[old] = left
            else:
                del self._counts[old]

    def extend(self, token_ids: Iterable[int]) -> None:
        for token_id in token_ids:
            self.append(token_id)

    @property
    def counts(self) -> Mapping[int, int]:
        """token id -> how many times it is in the window (only tokens with count > 0)."""
        return self._counts

    def tokens(self) -> list[int]:
        """The window's token ids, oldest first."""
        return list(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)
