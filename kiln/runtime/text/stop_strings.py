"""A request's stop strings, checked where its tokens are produced (the engine thread), so
that a stopped request ends, and frees its seat and KV blocks, in the step that produced the
stop rather than after the API has read it and sent an abort back.

It reads the reply as the API's OutputAssembler does (special tokens skipped, UTF-8 held
back until whole), so both find a stop at the same token; the API still cuts the text.
"""

from __future__ import annotations

from kiln.runtime.text.detokenizer import IncrementalDetokenizer
from kiln.runtime.text.tokenizer import Tokenizer


class StopStringChecker:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.stop = [s for s in stop if s]
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self.keep = max(len(s) for s in self.stop) - 1  # a tail that may start a stop
        self.tail = ""

    def feed(self, token_id: int) -> bool:
        """True once the reply so far contains a stop string."""
        text = self.tail + self.detok.feed(token_id)
        if any(s in text for s in self.stop):
            return True
        self.tail = text[len(text) - self.keep:] if self.keep else ""
        return False
