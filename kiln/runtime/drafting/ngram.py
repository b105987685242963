"""Prompt lookup: the tokens that followed the last place the sequence's end occurred before.

Each request keeps an index from every n-gram of its sequence (prompt and reply, n from
ngram_min to ngram_max) to where it last ended, extended as tokens arrive, so a proposal is a
few dictionary lookups however long the context. The longest suffix that occurred before wins;
the draft is what followed its latest earlier occurrence, and at most as many tokens as that
suffix (vLLM's suffix decoding, max_spec_factor 1): a long match is text being copied, and its
continuation is likely kept; a two-token match is as likely a coincidence, and a drafted token
the model rejects costs a row of the step. Replaying the bench's greedy replies through this
rule (bench/README.md, run Q) gave more tokens per unit of step time than drafting k tokens
at every match.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.runtime.drafting.config import SpeculativeConfig
from kiln.runtime.engine.request import Request


class NgramIndex:
    """One request's n-grams -> the end of their latest occurrence."""

    def __init__(self, ngram_min: int, ngram_max: int):
        self.sizes = range(ngram_max, ngram_min - 1, -1)  # the longest first
        self.last_end: dict[tuple[int, ...], int] = {}
        self.earlier: dict[int, int] = {}  # n -> where the current suffix of n last ended
        self.length = 0  # tokens indexed

    def extend(self, tokens: Sequence[int]) -> None:
        """Index tokens[self.length:] (tokens is the whole sequence so far)."""
        for end in range(self.length + 1, len(tokens) + 1):
            for n in self.sizes:
                if n <= end:
                    key = tuple(tokens[end - n:end])
                    prev = self.last_end.get(key)
                    self.last_end[key] = end
                    if end == len(tokens):
                        self.earlier[n] = prev
        self.length = len(tokens)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        self.extend(tokens)
        for n in self.sizes:
            end = self.earlier.get(n)
            if end is not None:
                return list(tokens[end:end + min(k, n)])
        return []


class NgramDrafter:
    """A `Drafter` (drafter.py) by prompt lookup."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, requests: list[Request], lengths: list[int]) -> list[list[int]]:
        drafts = []
        for req, k in zip(requests, lengths):
            if req.draft_state is None:
                req.draft_state = NgramIndex(self.config.ngram_min, self.config.ngram_max)
            drafts.append(req.draft_state.propose(req.all_token_ids, k) if k else [])
        return drafts
