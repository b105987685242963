"""Split a chat reply into reasoning_content and content, as it streams.

The model family's tags come from the catalogue (`CatalogueEntry.reasoning_tags`, a
`(start, end)` pair such as `THINK_TAGS`); the parser is driven by that pair alone. The tags
themselves are removed. /v1/completions does not use this: it returns the raw text.

Rules (vLLM's reasoning parsers, with the choices they leave open stated here):
- OUTSIDE (default): text before the first start tag is content; after it, reasoning until
  the end tag; after that, content to the end, later tags included. No end tag: everything
  after the start tag is reasoning (vLLM's deepseek_r1 rule).
- INSIDE: the prompt already opened the block (a template whose generation prompt ends
  with the start tag): the reply starts as reasoning.
- UNDECIDED: continue_final_message on a model that reasons first. The continuation may be
  reasoning or the answer, so everything is held back until the end tag (then it was
  reasoning) or the end of the reply (then it was content, as written).
- Whitespace: reasoning is kept as written, except a reasoning block that is only whitespace
  (`<think>\n\n</think>`), which counts as no reasoning. Content that is only whitespace
  before a start tag is dropped, and so is the whitespace right after the end tag (the
  "\n\n" separating the answer). Otherwise content whitespace is kept, also a reply that is
  only whitespace (it is flushed by `finish()`).
- A tag split across deltas is held back until it is complete or proven not to be a tag;
  `finish()` flushes whatever is still held. Any way of cutting the text into deltas gives
  the same result as `split_reasoning` on the whole text.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

THINK_TAGS = ("<think>", "</think>")


class ReasoningStart(enum.Enum):
    OUTSIDE = "outside"
    INSIDE = "inside"
    UNDECIDED = "undecided"

    @staticmethod
    def for_prompt(prompt: str, tags: tuple[str, str], *, continuing: bool = False,
                   reasons_first: bool = False) -> ReasoningStart:
        """Where a reply to `prompt` starts. A prompt whose last start tag is still open
        (the template opened the block, or the continued message did) starts INSIDE; a
        continued message on a model that reasons first is UNDECIDED; else OUTSIDE."""
        start, end = tags
        if prompt.rfind(start) > prompt.rfind(end):
            return ReasoningStart.INSIDE
        if continuing and reasons_first:
            return ReasoningStart.UNDECIDED
        return ReasoningStart.OUTSIDE


class ReasoningDelta(NamedTuple):
    reasoning: str
    content: str


class _State(enum.Enum):
    PRE = enum.auto()  # content, watching for the start tag
    REASONING = enum.auto()  # reasoning, watching for the end tag
    AFTER = enum.auto()  # just closed: dropping the whitespace before the answer
    CONTENT = enum.auto()  # content to the end, tags and all
    UNDECIDED = enum.auto()  # holding everything until the end tag or the end


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """Feed text deltas, get (reasoning, content) deltas; call `finish()` once at the end."""

    def __init__(self, tags: tuple[str, str],
                 start: ReasoningStart = ReasoningStart.OUTSIDE) -> None:
        self.start_tag, self.end_tag = tags
        self._state = {ReasoningStart.OUTSIDE: _State.PRE,
                       ReasoningStart.INSIDE: _State.REASONING,
                       ReasoningStart.UNDECIDED: _State.UNDECIDED}[start]
        self._held = ""
        self._scanned = 0  # UNDECIDED: how much of _held is known to hold no tag
        self._sent_content = False
        self._sent_reasoning = False

    def feed(self, delta: str) -> ReasoningDelta:
        text, self._held = self._held + delta, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            state = self._state
            if state is _State.PRE:
                i = text.find(self.start_tag)
                if i >= 0:
                    self._emit_content(text[:i], content)  # leading blanks: dropped
                    text = text[i + len(self.start_tag):]
                    self._state = _State.REASONING
                    continue
                out = text[:len(text) - _partial_tag_len(text, self.start_tag)]
                if not self._emit_content(out, content):
                    out = ""  # leading blanks: held until the tag or other text decides
                self._held = text[len(out):]
            elif state is _State.REASONING:
                i = text.find(self.end_tag)
                if i >= 0:
                    self._emit_reasoning(text[:i], reasoning)  # a blank block: dropped
                    text = text[i + len(self.end_tag):]
                    self._state = _State.AFTER
                    continue
                out = text[:len(text) - _partial_tag_len(text, self.end_tag)]
                if not self._emit_reasoning(out, reasoning):
                    out = ""
                self._held = text[len(out):]
            elif state is _State.AFTER:
                text = text.lstrip()
                if text:
                    self._state = _State.CONTENT
                    continue
            elif state is _State.CONTENT:
                content.append(text)
                self._sent_content = True
            else:
                text = self._scan_undecided(text)
                if text:
                    continue
            break
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        """Flush what is held back: a partial tag, leading whitespace, an undecided reply."""
        held, self._held = self._held, ""
        if self._state is _State.REASONING:
            if self._sent_reasoning or held.strip():
                return ReasoningDelta(held, "")
            return ReasoningDelta("", "")
        return ReasoningDelta("", held)

    def _scan_undecided(self, text: str) -> str:
        """UNDECIDED: resolve on the first tag; returns the text left to process, or ''."""
        since = max(0, self._scanned - max(len(self.start_tag), len(self.end_tag)) + 1)
        i_end = text.find(self.end_tag, since)
        i_start = text.find(self.start_tag, since)
        if i_end >= 0 and (i_start < 0 or i_end < i_start):
            self._state = _State.REASONING  # it was reasoning all along
            return text
        if i_start >= 0:
            self._state = _State.PRE  # the reply opens its own block: before it is content
            return text
        self._held, self._scanned = text, len(text)
        return ""

    def _emit_content(self, text: str, out: list[str]) -> bool:
        """Emit content; False (nothing emitted) for blanks before any content was sent."""
        if not self._sent_content and not text.strip():
            return False
        out.append(text)
        self._sent_content = True
        return True

    def _emit_reasoning(self, text: str, out: list[str]) -> bool:
        """Emit reasoning; False (nothing emitted) for blanks before any reasoning was sent."""
        if not self._sent_reasoning and not text.strip():
            return False
        out.append(text)
        self._sent_reasoning = True
        return True


def split_reasoning(text: str, tags: tuple[str, str],
                    start: ReasoningStart = ReasoningStart.OUTSIDE
                    ) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole reply; None where there is none."""
    parser = ReasoningParser(tags, start)
    a, b = parser.feed(text), parser.finish()
    return (a.reasoning + b.reasoning) or None, (a.content + b.content) or None
