"""What the engine asks of a drafter, whatever drafts: prompt lookup now; a draft model or an
MTP head would propose the same way, batched over the step's requests, keeping what it needs
per request in `Request.draft_state`."""

from __future__ import annotations

from typing import Protocol

from kiln.runtime.drafting.config import SpeculativeConfig
from kiln.runtime.drafting.ngram import NgramDrafter
from kiln.runtime.engine.request import Request


class Drafter(Protocol):
    def propose(self, requests: list[Request], lengths: list[int]) -> list[list[int]]:
        """For each request (caught up with its tokens), at most lengths[i] tokens to check
        after its last one; [] when it has no guess."""


def make_drafter(config: SpeculativeConfig) -> Drafter:
    return NgramDrafter(config)
