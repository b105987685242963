"""Structured output: what a request's text must match, compiled once per model, stepped per token.

`GrammarSpec` is what a request asks for (api/ builds it from response_format / tool_choice).
`GrammarCompilerCache` turns a spec into an xgrammar `CompiledGrammar` for the loaded model and
keeps the last few (LRU, thread-safe: call `get` from a worker thread, never on the event loop).
`GrammarState` is one request's matcher: each step it writes the request's row of the batch's
token bitmask (`[B, ceil(V / 32)] int32`, bit j of word w allows token 32 * w + j; all-ones rows
are unconstrained), and it accepts the token the sampler drew. When the grammar is complete it
allows only the stop tokens; accepting one terminates it, and the request finishes.

V is the model's logits width, which may exceed the tokenizer's vocabulary (padded embeddings):
the ids past the vocabulary are never allowed. Control tokens other than the stop tokens (SmolLM2's
`<|im_start|>`, `<repo_name>`, ...) are never allowed either: the detokenizer drops them, so
letting a grammar spell text with them would corrupt the reply.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")
# Whitespace the JSON grammars allow between tokens, in a row: enough for pretty-printed JSON a
# few levels deep, not enough for a small model to loop on newlines until max_tokens.
MAX_JSON_WHITESPACE = 24
# In a tool call's arguments: one character (a space after ':' and ','). Calls are read by
# programs, and under heavy penalties 24 a gap was still enough to fill max_tokens.
MAX_TOOL_CALL_WHITESPACE = 1


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request's output must match. Hashable: equal specs share one compiled grammar.

    text: json_schema -> the schema as JSON text; regex -> the pattern; ebnf -> the grammar
    (root rule `root`); structural_tag -> xgrammar's structural tag as JSON text; json_object -> "".
    param: the request field a compile error names (not part of the cache key).
    """

    kind: str
    text: str = ""
    param: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind {self.kind!r} is not one of {GRAMMAR_KINDS}")
        if self.kind != "json_object" and not self.text:
            raise ValueError(f"a {self.kind} grammar needs its text")

    @classmethod
    def json_schema(cls, schema: dict | bool, param: str = "response_format") -> GrammarSpec:
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("The JSON schema must be an object (or a boolean).",
                                      param=param)
        # Key order is kept: xgrammar writes properties in the schema's order.
        return cls("json_schema", json.dumps(schema, ensure_ascii=False), param)


class GrammarCompilerCache:
    """One xgrammar TokenizerInfo + GrammarCompiler per loaded model, and an LRU of compiled
    grammars keyed by `GrammarSpec`. `get` may run on any thread, several at once."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None,
                 capacity: int = 64, max_threads: int = 2) -> None:
        """vocab_size: the model's logits width (default: the tokenizer's vocabulary).
        xgrammar (and the transformers it imports, seconds of start-up) loads with the
        first grammar, not with the engine."""
        self.tokenizer, self.max_threads = tokenizer, max_threads
        self.vocab_size = vocab_size or tokenizer.vocab_for_grammar().vocab_size
        self.capacity = capacity
        self._entries: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self.hits = self.misses = 0
        self._info = self._token_bytes = None

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    def _make_compiler(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        tokenizer, vocab = self.tokenizer, self.tokenizer.vocab_for_grammar()
        stop = [i for i in vocab.stop_token_ids if i < self.vocab_size]
        encoded = list(vocab.encoded_vocab[:self.vocab_size])
        for i in tokenizer.special_token_ids:  # "" makes xgrammar treat a token as special
            if i < self.vocab_size and i not in tokenizer.stop_token_ids:
                encoded[i] = ""
        info = xgr.TokenizerInfo(encoded, xgr.VocabType[vocab.vocab_type],
                                 vocab_size=self.vocab_size, stop_token_ids=stop,
                                 add_prefix_space=vocab.add_prefix_space)
        self._info = info
        # Our LRU is the cache; xgrammar's own would hold every grammar ever compiled.
        return xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)

    @property
    def token_bytes(self) -> list[bytes]:
        """Each token's text as bytes, as xgrammar decodes the vocabulary (once)."""
        _ = self.compiler  # makes the tokenizer info on first use
        with self._lock:
            if self._token_bytes is None:
                self._token_bytes = list(self._info.decoded_vocab)
            return self._token_bytes

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def get(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar; raises InvalidRequestError(param=spec.param) if it does not
        compile. Blocking (milliseconds to a second for big schemas): not on the event loop."""
        with self._lock:
            compiled = self._entries.get(spec)
            if compiled is not None:
                self._entries.move_to_end(spec)
                self.hits += 1
                return compiled
            self.misses += 1
        compiled = self._compile(spec)  # outside the lock: other specs compile meanwhile
        with self._lock:
            self._entries[spec] = compiled
            self._entries.move_to_end(spec)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return compiled

    def check(self, spec: GrammarSpec, prefix: str = "") -> None:
        """Raise the 400 a request with this grammar would meet: a spec that does not compile
        (naming spec.param), or a prefix it rejects. Blocking, as `get`."""
        compiled = self.get(spec)
        if prefix:
            GrammarState(compiled, prefix)

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        c = self.compiler
        try:
            if spec.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', strict_mode=False,
                                             max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if spec.kind == "json_schema":
                return c.compile_json_schema(spec.text, max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            if spec.kind == "ebnf":
                return c.compile_grammar(spec.text)
            return c.compile_structural_tag(spec.text)
        except (RuntimeError, ValueError) as exc:  # xgrammar's errors; pydantic's too
            what = "JSON schema" if spec.kind in ("json_schema", "json_object") else spec.kind
            raise InvalidRequestError(f"Invalid {what} in '{spec.param}': "
                                      f"{_xgrammar_message(exc)}", param=spec.param,
                                      code="invalid_value") from None


class GrammarState:
    """One request's position in its grammar. Used by the engine thread only."""

    def __init__(self, compiled: xgr.CompiledGrammar, prefix: str = "",
                 token_bytes: list[bytes] | None = None) -> None:
        """prefix: text already in the reply (continue_final_message) that the grammar must
        accept first; a prefix it rejects is a 400 on `continue_final_message`.
        token_bytes: each token's text as bytes (GrammarCompilerCache.token_bytes), to tell
        which tokens the grammar dictated."""
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.token_bytes = token_bytes
        if prefix and not self.matcher.accept_string(prefix):
            raise InvalidRequestError("The final assistant message does not match the "
                                      "requested format, so it cannot be continued.",
                                      param="continue_final_message")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (a CPU int32 tensor)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def dictates(self, token_id: int) -> bool:
        """Whether the grammar left the model no choice of this token's text: it is a prefix
        of the jump-forward string (the text every continuation must start with). Call it
        before `accept`. Such tokens are the grammar's, not the model's: like drafted tokens,
        they stay out of the penalty window, so a call's fixed head (its quotes, its name,
        its newlines) cannot push the model off the structure it must write next."""
        text = self.token_bytes[token_id] if self.token_bytes is not None \
            and 0 <= token_id < len(self.token_bytes) else b""
        return bool(text) and self.matcher.find_jump_forward_string().encode().startswith(text)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it (then the
        matcher is unchanged and the request should be finished)."""
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        """A stop token was accepted after the grammar completed: the reply is done."""
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """The grammar is matched; only a stop token may follow."""
        return self.matcher.is_completed()


def build_grammar_bitmask(states: list[GrammarState | None],
                          vocab_size: int) -> torch.Tensor | None:
    """The batch's `[B, ceil(V / 32)] int32` mask on the host (xgrammar writes host memory),
    row i from states[i]; all ones (-1) where a row has no grammar. None when no row has one
    (the sampler then skips the mask). The sampler sends it with the step's other columns.
    """
    if all(s is None for s in states):
        return None
    bitmask = torch.full((len(states), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for row, state in enumerate(states):
        if state is not None:
            state.fill_bitmask(bitmask, row)
    return bitmask


_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _xgrammar_message(exc: Exception) -> str:
    """xgrammar's error without its timestamp and C++ source location."""
    text = str(exc).strip().splitlines()
    first = _XGRAMMAR_PREFIX.sub("", text[0]) if text else type(exc).__name__
    return first.rstrip(".") + "."
