"""Token ids -> text while they stream, one id at a time.

A byte-level token can end in the middle of a UTF-8 character (an emoji is often two or three
tokens), so the bytes of an unfinished character are held back until the token that completes
it arrives. Each step costs the length of one token, never a re-decode of the sequence, and the
pieces joined are exactly `Tokenizer.decode(ids)` (bytes that never form a character become
U+FFFD there and here alike).
"""

from __future__ import annotations

import codecs

from kiln.runtime.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens: `feed` each id, then `finish` once.

    Special tokens (like <|im_end|>) appear as their text unless `skip_special_tokens`.
    """

    __slots__ = ("_tokenizer", "_skip_ids", "_utf8")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """The text this token finishes; "" while it only starts a character."""
        if token_id in self._skip_ids:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def finish(self) -> str:
        """At the end of the sequence: held bytes of a character never finished, as U+FFFD."""
        return self._utf8.decode(b"", final=True)

    @property
    def num_pending_bytes(self) -> int:
        """Bytes held back, waiting for the rest of their character (0 to 3)."""
        return len(self._utf8.getstate()[0])

    def token_text(self, token_id: int) -> str:
        """The `token` of an OpenAI logprob entry: the token's own text, or, when its bytes are
        not whole UTF-8 characters, OpenAI's spelling of them ("bytes:\\xf0\\x9f")."""
        raw = self._tokenizer.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)

    def token_bytes(self, token_id: int) -> list[int]:
        """The `bytes` of an OpenAI logprob entry."""
        return list(self._tokenizer.token_bytes(token_id))
