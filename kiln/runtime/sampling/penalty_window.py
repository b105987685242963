"""The penalty window: which generated tokens presence/frequency/repetition penalties see.

Contract: the last `repeat_last_n` generated tokens (default 64; -1 = the whole reply;
0 = penalties off). The prompt never counts; reasoning tokens do. Tokens a grammar dictated
(its fixed text: a tool call's head, a schema's keys; `GrammarState.dictates`) are not the
model's choices and stay out, as the reference runtime keeps drafted tokens out: penalties
still act on every token a grammar allows, but a fixed head cannot penalise the structure
that must follow it. A request that continues a
conversation still held in the cache starts with the tail of the earlier reply (`carried`);
a request with a seed always starts empty. The window size is the request's own snapshot, so
a smaller window applies from the request's first token: the carried tail is cut to it.

The sampler builds a row's window from its token lists when the row joins its batch, then
keeps it as a ring that takes each new window token (sampler_rows.py): the kernel counts the
tokens itself, so their order does not matter.
"""

from __future__ import annotations

from collections.abc import Sequence


def window_tokens(repeat_last_n: int, generated: list[int],
                  carried: Sequence[int] = ()) -> list[int]:
    """The window's token ids, oldest first: the last repeat_last_n of carried + generated."""
    if repeat_last_n == 0:
        return []
    if repeat_last_n == -1:
        return [*carried, *generated]
    if repeat_last_n < -1:
        raise ValueError(f"repeat_last_n {repeat_last_n} must be >= -1")
    own = generated[-repeat_last_n:]  # a list's slice is a new list: run once per row a step
    need = repeat_last_n - len(own)
    return list(carried[-need:]) + own if need > 0 and carried else own
