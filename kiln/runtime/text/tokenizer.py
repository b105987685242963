"""Text <-> token ids, built from the vocabulary a GGUF file carries (it has no tokenizer.json).

`GGUFVocab` reads llama.cpp's `tokenizer.ggml.*` keys; a builder per `tokenizer.ggml.model` turns
them into a `tokenizers.Tokenizer` that encodes the way Hugging Face transformers does when it
loads the same file with `gguf_file=` (tests/test_tokenizer.py and tests/test_gemma3.py hold us
to that). Two builders, registered in `_BUILDERS`: "gpt2" (byte-level BPE: SmolLM2, Llama 3,
Qwen) and "llama" (SentencePiece pieces spelled with "▁", byte fallback: Gemma, Llama 2, Phi-3).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from os import PathLike

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

# llama.cpp's token types (gguf.TokenType).
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6

# Tokens that end a chat turn in the common templates. Counted as stop tokens when the file has
# them as control tokens, next to EOS and the file's own eot/eom ids.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>",
                      "<|endoftext|>", "<|end_of_text|>", "<|return|>", "<EOT>")

# `tokenizer.ggml.pre` -> the regex llama.cpp splits text with before BPE. These are the names
# transformers maps too; any other name (e.g. "smollm", "gpt2") gets GPT-2's own regex, as in
# transformers. NB: llama.cpp splits "smollm" digits one by one first, which differs on runs of
# spaces before a digit ("a  1"); transformers, our oracle, does not.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx",
                     "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """The tokenizer metadata of one GGUF file, under readable names."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
    pre: str | None  # tokenizer.ggml.pre: which pre-tokenizer regex the merges were learned with
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    scores: list[float]
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    eom_token_id: int | None
    add_bos: bool
    add_eos: bool
    arch: str = ""  # general.architecture: some SentencePiece vocabularies are built by arch
    unk_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if len(self.token_types) != len(self.tokens):
            raise ValueError(f"GGUF has {len(self.tokens)} tokens but "
                             f"{len(self.token_types)} token types")
        for name in ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id",
                     "unk_token_id", "pad_token_id"):
            token_id = getattr(self, name)
            if token_id is not None and not 0 <= token_id < len(self.tokens):
                raise ValueError(f"GGUF {name} {token_id} is outside the vocabulary "
                                 f"of {len(self.tokens)} tokens")

    @classmethod
    def from_gguf(cls, path_or_reader) -> GGUFVocab:
        reader = gguf_reader(path_or_reader)

        def get(key: str, default=None):
            field = reader.fields.get(f"tokenizer.ggml.{key}")
            return default if field is None else field.contents()

        model = get("model")
        if model is None:
            raise ValueError("GGUF has no tokenizer (tokenizer.ggml.model is missing)")
        tokens = get("tokens", [])
        add_bos = get("add_bos_token")
        return cls(
            model=model, pre=get("pre"), tokens=tokens,
            token_types=get("token_type") or [NORMAL] * len(tokens), merges=get("merges", []),
            scores=get("scores", []),
            bos_token_id=get("bos_token_id"), eos_token_id=get("eos_token_id"),
            eot_token_id=get("eot_token_id"), eom_token_id=get("eom_token_id"),
            # A file without the flag: llama.cpp (and transformers) add BOS only for SentencePiece.
            add_bos=bool(model == "llama" if add_bos is None else add_bos),
            add_eos=bool(get("add_eos_token", False)),
            arch=_field(reader, "general.architecture", ""),
            unk_token_id=get("unknown_token_id"), pad_token_id=get("padding_token_id"),
        )


@dataclass(frozen=True, slots=True)
class BuiltVocab:
    """What a builder makes of a `GGUFVocab`; `Tokenizer` adds what every vocabulary shares."""

    backend: Backend  # model, pre-tokenizer and decoder; no added tokens yet
    pieces: list[str]  # each id's spelling in `backend` (the grammar's "encoded vocab")
    token_bytes: list[bytes]  # each id's raw bytes, what it contributes to the decoded text
    special_ids: list[int]  # control tokens to add as special tokens
    vocab_type: str  # the name of the matching xgrammar.VocabType
    add_prefix_space: bool


@dataclass(frozen=True, slots=True)
class GrammarVocab:
    """What `xgrammar.TokenizerInfo` needs:

        xgr.TokenizerInfo(v.encoded_vocab, xgr.VocabType[v.vocab_type], vocab_size=v.vocab_size,
                          stop_token_ids=v.stop_token_ids, add_prefix_space=v.add_prefix_space)
    """

    encoded_vocab: list[str]
    vocab_type: str
    vocab_size: int
    stop_token_ids: list[int]
    add_prefix_space: bool


class Tokenizer:
    """Encodes and decodes text with a GGUF's own vocabulary."""

    def __init__(self, vocab: GGUFVocab) -> None:
        builder = _BUILDERS.get(vocab.model)
        if builder is None:
            raise ValueError(f"GGUF tokenizer model {vocab.model!r} is not supported "
                             f"(supported: {', '.join(sorted(_BUILDERS))})")
        built = builder(vocab)
        self._vocab = vocab
        self._built = built
        self._backend = built.backend
        self._backend.add_special_tokens([
            AddedToken(built.pieces[i], normalized=False, special=True) for i in built.special_ids])
        # User-defined tokens (like `<think>`) are matched whole in text but are not special.
        self._backend.add_tokens([
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(vocab.tokens, vocab.token_types, strict=True)
            if kind == USER_DEFINED and self._backend.token_to_id(token) is not None])
        self.special_token_ids: frozenset[int] = frozenset(built.special_ids)
        stop = {vocab.eos_token_id, vocab.eot_token_id, vocab.eom_token_id}
        stop.update(i for i in built.special_ids if vocab.tokens[i] in END_OF_TURN_TOKENS)
        self.stop_token_ids: frozenset[int] = frozenset(stop - {None})

    @classmethod
    def from_gguf(cls, path_or_reader) -> Tokenizer:
        """From a GGUF path, a `gguf.GGUFReader` or a `GGUFFile`."""
        return cls(GGUFVocab.from_gguf(path_or_reader))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it become their single id.

        Like transformers' `tokenizer(text)`, BOS (EOS) is added only when the GGUF says
        add_bos_token (add_eos_token). A rendered chat template writes its own BOS, so encode
        it with `add_special_tokens=False`, as `apply_chat_template` does.
        """
        # The batch call lets other threads run while it works (encode holds the GIL: a long
        # prompt would freeze the server's event loop, tokenized on a worker or not); the
        # fast one skips the character offsets kiln never reads.
        ids = self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        if add_special_tokens:
            if self._vocab.add_bos and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self._vocab.add_eos and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The token as the vocabulary spells it (byte-level: "Ġworld" for " world")."""
        return self._built.pieces[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes the token adds to decoded text; may be part of a UTF-8 character."""
        return self._built.token_bytes[token_id]

    def vocab_for_grammar(self) -> GrammarVocab:
        return GrammarVocab(
            encoded_vocab=list(self._built.pieces), vocab_type=self._built.vocab_type,
            vocab_size=self.vocab_size, stop_token_ids=sorted(self.stop_token_ids),
            add_prefix_space=self._built.add_prefix_space)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab.tokens)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token covers: a text of n characters is at least
        n / max_token_chars tokens (a bound known without encoding it)."""
        return max(max(map(len, self._built.token_bytes)), max(map(len, self._built.pieces)))

    @property
    def add_bos(self) -> bool:
        return self._vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self._vocab.add_eos

    @property
    def bos_token_id(self) -> int | None:
        return self._vocab.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._vocab.eos_token_id

    @property
    def bos_token(self) -> str | None:
        return self._spelling(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._spelling(self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        return self._spelling(self._vocab.pad_token_id)

    @property
    def unk_token(self) -> str | None:
        return self._spelling(self._vocab.unk_token_id)

    def _spelling(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._vocab.tokens[token_id]


# --- builders, one per tokenizer.ggml.model -------------------------------------------------


def build_byte_level(vocab: GGUFVocab) -> BuiltVocab:
    """Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): every token is spelled in GPT-2's
    printable byte alphabet, so " world" is "Ġworld"."""
    alphabet = _byte_alphabet()
    char_to_byte = {char: byte for byte, char in enumerate(alphabet)}
    pieces, token_bytes = [], []
    for token in vocab.tokens:
        if all(char in char_to_byte for char in token):
            pieces.append(token)
            token_bytes.append(bytes(char_to_byte[char] for char in token))
        else:  # written as plain text in the file (llama.cpp does that for some added tokens)
            raw = token.encode("utf-8")
            pieces.append("".join(alphabet[byte] for byte in raw))
            token_bytes.append(raw)
    merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges]
    backend = Backend(BPE(vocab={piece: i for i, piece in enumerate(pieces)}, merges=merges,
                          dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                          fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(vocab.pre)
    if split is None:  # GPT-2's regex, built into ByteLevel
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the alphabet is a llama.cpp mislabel; like transformers,
    # we leave it an ordinary token rather than grow the vocabulary past the model's.
    special_ids = [i for i, token in enumerate(vocab.tokens)
                   if vocab.token_types[i] == CONTROL and all(c in char_to_byte for c in token)]
    return BuiltVocab(backend=backend, pieces=pieces, token_bytes=token_bytes,
                      special_ids=special_ids, vocab_type="BYTE_LEVEL", add_prefix_space=False)


# SentencePiece files of these architectures follow Gemma's conventions (transformers'
# GGUF_SENTENCEPIECE_BUILDERS); any other "llama" vocabulary is built like Llama 2's.
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space


def build_sentencepiece(vocab: GGUFVocab) -> BuiltVocab:
    """SentencePiece ("llama"): pieces spell a space as "▁", the 256 "<0xXX>" pieces spell bytes
    no piece covers (byte fallback), and the merge order comes from the vocabulary.

    When the file lists no merges (Gemma's does not), they are rebuilt from the vocabulary as
    transformers does: every way a piece splits into two pieces is a merge, ranked by the piece's
    score. Gemma's scores do not follow its merge order, so for Gemma the rank is the piece's
    position in the file, and its runs of spaces ("  ", stored as real spaces) are respelled
    "▁▁" first. The result encodes like transformers' GemmaTokenizer / LlamaTokenizer (Phi-3:
    its own variant) on the same file.
    """
    tokens = vocab.tokens
    gemma, phi3 = vocab.arch in _GEMMA_ARCHS, vocab.arch == "phi3"
    if gemma:
        pieces = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        priority = {piece: -float(i) for i, piece in enumerate(pieces)}
    else:
        pieces = list(tokens)
        scores = vocab.scores or [0.0] * len(pieces)
        priority = dict(zip(pieces, map(float, scores), strict=True))
    ids = {piece: i for i, piece in enumerate(pieces)}
    merges = ([tuple(merge.split(" ")) for merge in vocab.merges] if vocab.merges
              else _merges_from_vocab(ids, priority))
    backend = Backend(BPE(vocab=ids, merges=merges, dropout=None, fuse_unk=True,
                          byte_fallback=True, unk_token="<unk>" if gemma else None))
    decode = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:  # no prefix space; every space is a "▁"
        backend.normalizer = normalizers.Replace(" ", _SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif phi3:  # the prefix space comes from a normalizer, so "  hi" keeps both spaces
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE),
                                                   normalizers.Replace(" ", _SPACE)])
    else:  # Llama 2: "▁" before the first piece of the text only
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE,
                                                         prepend_scheme="first", split=False)
    if not gemma:
        decode.append(decoders.Strip(" ", 1, 0))  # the prefix space is not part of the text
    backend.decoder = decoders.Sequence(decode)
    token_bytes = [_sentencepiece_bytes(piece, kind) for piece, kind in
                   zip(pieces, vocab.token_types, strict=True)]
    # Control tokens, and (as transformers registers them by name) the file's BOS, EOS, UNK and
    # PAD even when typed otherwise: Llama 2's "<unk>" is an UNKNOWN token, yet special.
    named = {vocab.bos_token_id, vocab.eos_token_id, vocab.unk_token_id, vocab.pad_token_id}
    special_ids = [i for i, kind in enumerate(vocab.token_types) if kind == CONTROL or i in named]
    return BuiltVocab(backend=backend, pieces=pieces, token_bytes=token_bytes,
                      special_ids=special_ids, vocab_type="BYTE_FALLBACK",
                      add_prefix_space=not gemma)


def _merges_from_vocab(ids: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """transformers' `generate_merges`: each split of a piece into two pieces, best piece first;
    ties go to the longer left part, then the longer right part, then file order."""
    ranked = []
    for piece, score in priority.items():
        splits = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                  if piece[:k] in ids and piece[k:] in ids]
        splits.sort(key=lambda m: (ids[m[0]], ids[m[1]]))
        ranked.extend(splits)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _sentencepiece_bytes(piece: str, kind: int) -> bytes:
    if kind == BYTE and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace(_SPACE, " ").encode("utf-8")


_BUILDERS: dict[str, Callable[[GGUFVocab], BuiltVocab]] = {
    "gpt2": build_byte_level,
    "llama": build_sentencepiece,
}


@cache
def _byte_alphabet() -> tuple[str, ...]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves,
    the other 68 bytes are shifted to U+0100 onwards (so space is "Ġ", newline "Ċ")."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    alphabet, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(256 + shifted))
            shifted += 1
    return tuple(alphabet)


def gguf_reader(source):
    """The `gguf.GGUFReader` of `source`: a path, a reader, or an object holding one in
    `.reader` (runtime.gguf_loader.GGUFFile), so callers can share the file they opened."""
    if isinstance(source, (str, PathLike)):
        from gguf import GGUFReader

        return GGUFReader(source)
    return getattr(source, "reader", source)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()
