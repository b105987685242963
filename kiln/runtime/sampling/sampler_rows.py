"""The sampler's per-row host columns, carried from one step to the next (vLLM's persistent
batch): a row's settings, seed and penalty window are worked out when its request joins the
batch and kept while it stays, so a step's metadata costs work for what changed (rows that
joined, each row's new token) instead of every row's settings and window
(bench/host_step.py: at 256 rows this was the host's largest part of a step).

Rows are matched by request against the last step's batch: kept rows are gathered by index,
wherever they moved, and rows that joined are built from their request. A row's penalty
window is a ring: the kernel and its reference count the window's tokens, so their order
does not matter, and each new window token overwrites the oldest (-1 where the ring is not
full). A whole-reply window (repeat_last_n -1) only grows.
"""

from __future__ import annotations

import numpy as np

from kiln.runtime.engine.request import Request
from kiln.runtime.sampling.penalty_window import window_tokens

WIDTH_STEP = 16  # the ring's columns grow by this many

# (name, dtype, fill, columns) of each per-row array: [n] or [n, columns]
_ARRAYS = (("values", np.float32, 0.0, 7),     # SamplingParams.columns
           ("seeds", np.int64, 0, None),        # a seeded row's seed, else 0
           ("seeded", np.bool_, False, None),
           ("sampled", np.bool_, False, None),  # not argmax
           ("window", np.int64, -1, 0),         # the ring, -1 padded (grows: _fit_window)
           ("window_size", np.int64, 0, None),  # repeat_last_n; 0 = no penalties
           ("window_count", np.int64, 0, None),  # tokens put in the ring so far
           ("window_seen", np.int64, 0, None),  # len(window_token_ids) when last put
           ("biased", np.bool_, False, None),   # a logit_bias, or min_tokens' banned stops
           ("grammar", np.bool_, False, None),
           ("top", np.int64, 0, None),          # logprobs' top-N asked
           ("flags", np.bool_, False, 3))       # top_k, top_p, min_p in use (sampled rows)


class SamplerRows:
    """The columns of the rows the sampler saw last; `update` brings them to a new batch."""

    def __init__(self):
        self.requests: list[Request] = []
        self._index: dict[Request, int] = {}
        for name, dtype, fill, columns in _ARRAYS:
            setattr(self, name, np.full((0,) if columns is None else (0, columns), fill, dtype))
        self.window_rows = np.zeros(0, np.int64)  # rows with penalties
        self._window_reqs: list[Request] = []
        self._batch_columns()

    def update(self, requests: list[Request]) -> None:
        """Match the rows to `requests` (in their order), then put each row's window tokens
        appended since the last step in its ring."""
        if requests != self.requests:  # identity per element (Request compares by identity)
            self._match(requests)
        else:
            self.window = self.window.copy()  # the last step's metadata may still read it
        self._put_new_window_tokens()

    def _match(self, requests: list[Request]) -> None:
        n, index = len(requests), self._index
        src = np.fromiter((index.get(r, -1) for r in requests), np.int64, n)
        kept = np.flatnonzero(src >= 0)
        for name, dtype, fill, _ in _ARRAYS:
            old = getattr(self, name)
            new = np.full((n, *old.shape[1:]), fill, dtype)
            new[kept] = old[src[kept]]
            setattr(self, name, new)
        # The columns some row still uses (rows with the longest windows may have left).
        used = np.where(self.window_size > 0, np.minimum(self.window_count, self.window_size),
                        self.window_count)
        self.window = self.window[:, :int(used.max(initial=0))]
        self.requests = list(requests)
        self._index = {r: i for i, r in enumerate(requests)}
        for i in np.flatnonzero(src < 0).tolist():
            self._build(i, requests[i])
        self.window_rows = np.flatnonzero(self.window_size)
        self._window_reqs = [requests[i] for i in self.window_rows.tolist()]
        self._batch_columns()

    def _batch_columns(self) -> None:
        """What a step reads of the batch as a whole, worked out once per batch."""
        self.value_columns = self.values.T.copy()  # [7, n]: a column per setting
        self.seeded_rows = np.flatnonzero(self.seeded).tolist()
        self.drawn_rows = np.flatnonzero(self.sampled & ~self.seeded)  # the server draws
        self.biased_rows = np.flatnonzero(self.biased).tolist()
        self.has_grammar = bool(self.grammar.any())
        self.num_top = int(self.top.max(initial=0))
        # a ring's column is its count modulo this: its size, or never for a whole reply (-1)
        self.window_wrap = np.where(self.window_size > 0, self.window_size, np.iinfo(np.int64).max)
        used = self.flags.any(axis=0).tolist()  # has_top_k, has_top_p, has_min_p, all_greedy
        self.batch_flags = (used[0], used[1], used[2], not self.sampled.any())

    def _build(self, i: int, r: Request) -> None:
        """Row i from its request alone: what a step without earlier rows would send."""
        sp, options = r.sampling, r.options
        self.values[i] = sp.columns
        if sp.seed is not None:
            self.seeds[i], self.seeded[i] = sp.seed, True
        if not sp.is_greedy:
            self.sampled[i] = True
            self.flags[i] = (sp.top_k > 1, sp.top_p < 1, sp.min_p > 0)
        self.biased[i] = bool(options.logit_bias) or options.min_tokens > 0
        self.grammar[i] = r.grammar is not None
        self.top[i] = options.logprobs or 0
        if sp.has_penalties:
            tokens = window_tokens(sp.repeat_last_n, r.window_token_ids, r.window_prefix)
            self._fit_window(len(tokens))
            self.window[i, :len(tokens)] = tokens
            self.window_size[i] = sp.repeat_last_n
            self.window_count[i] = len(tokens)
            self.window_seen[i] = len(r.window_token_ids)

    def _fit_window(self, width: int) -> None:
        """At least `width` columns, grown by whole runs of WIDTH_STEP (the width is the
        kernel's loop length: no wider than a few columns past the longest window)."""
        have = self.window.shape[1]
        if width > have:
            grown = np.full((len(self.window), -(-width // WIDTH_STEP) * WIDTH_STEP), -1,
                            np.int64)
            grown[:, :have] = self.window
            self.window = grown

    def _put_new_window_tokens(self) -> None:
        rows, reqs = self.window_rows, self._window_reqs
        if not reqs:
            return
        lengths = np.fromiter(map(len, (r.window_token_ids for r in reqs)), np.int64, len(reqs))
        new = lengths - self.window_seen[rows]
        # Most steps put one token a row: those in one assignment, others one by one (a
        # grammar's dictated tokens stay out of the window).
        if (new == 1).all():
            self._put(rows, np.array([r.window_token_ids[-1] for r in reqs], dtype=np.int64))
        elif new.any():
            one = np.flatnonzero(new == 1)
            self._put(rows[one], np.array([reqs[j].window_token_ids[-1] for j in one.tolist()],
                                          dtype=np.int64))
            for j in np.flatnonzero(new > 1).tolist():
                for token in reqs[j].window_token_ids[self.window_seen[rows[j]]:]:
                    self._put(rows[j:j + 1], np.array([token], dtype=np.int64))
        self.window_seen[rows] = lengths

    def in_flight_columns(self, src: np.ndarray | None) -> list[np.ndarray]:
        """[rows, ring columns, rows in the last step] of the penalty windows whose token is
        in flight (--async-scheduling), given each row's row in the last step (-1: none;
        None: the same rows): the column that token takes once read, which the step's
        window on the device holds it in meanwhile (the ring grown to hold it)."""
        rows = self.window_rows
        if src is not None:
            rows = rows[src[rows] >= 0]
        columns = self.window_count[rows] % self.window_wrap[rows]
        if len(columns):
            self._fit_window(int(columns.max()) + 1)
        return [rows, columns, rows if src is None else src[rows]]

    def _put(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        count = self.window_count[rows]
        columns = count % self.window_wrap[rows]
        if len(columns):
            self._fit_window(int(columns.max()) + 1)
        self.window[rows, columns] = tokens
        self.window_count[rows] = count + 1
