"""kiln.runtime.text.detokenizer: streamed text equals Tokenizer.decode of the whole sequence."""

import random

import pytest

from kiln.runtime.text.detokenizer import IncrementalDetokenizer
from kiln.runtime.text.tokenizer import Tokenizer

MULTIBYTE = [
    "😀", "👍🏽 thumbs", "👨‍👩‍👧‍👦 family", "🇫🇷🇯🇵🇧🇷", "I ❤️ Zürich", "🤖🚀🔥🎉", "a😀b😃c",
    "中文字符测试，还有标点。", "日本語のテキストです", "한국어 문장입니다", "Ελληνικά γράμματα",
    "Русский текст", "العربية", "हिन्दी भाषा", "ภาษาไทย", "e\u0301 combining", "𝕏𝕐 math",
    "mixed: café 😀 中文 ∀x∈ℝ “quotes” — done…", "\U0010fffd private", "tab\t😀\nnewline",
]


@pytest.fixture(scope="module")
def tok(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


def _stream(tok, ids, skip_special_tokens=False):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces = [detok.feed(i) for i in ids]
    return pieces, detok.finish()


def _is_partial_character(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_strings_split_characters_across_tokens(tok):
    """The strings below must make the detokenizer hold bytes, or the next test proves nothing."""
    split = [s for s in MULTIBYTE if any(_is_partial_character(tok.token_bytes(i))
                                         for i in tok.encode(s))]
    assert len(split) >= len(MULTIBYTE) // 2, split


@pytest.mark.parametrize("text", MULTIBYTE)
def test_streaming_gives_decode_of_all_and_never_a_partial_character(tok, text):
    ids = tok.encode(text)
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids) == text
    assert tail == ""
    emitted = ""
    for step, piece in enumerate(pieces):
        assert "\ufffd" not in piece, f"step {step} emitted {piece!r}"
        emitted += piece
        assert text.startswith(emitted), f"step {step} emitted {piece!r}"


def test_held_bytes_are_counted_and_released(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert [detok.feed(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert 0 < detok.num_pending_bytes <= 3
    assert detok.feed(ids[-1]) == "😀" and detok.num_pending_bytes == 0


def test_an_unfinished_character_comes_out_of_finish_as_replacement(tok):
    ids = tok.encode("ok 😀")[:-1]
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) == "ok " and tail == "\ufffd"
    assert "".join(pieces) + tail == tok.decode(ids)


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_random_ids_stream_to_decode_of_all(tok, skip_special_tokens):
    """Any id sequence, valid UTF-8 or not, special tokens included, gives decode()'s text."""
    rng = random.Random(7)
    non_ascii_bytes = [i for i in range(tok.vocab_size)
                       if _is_partial_character(tok.token_bytes(i))]
    specials = sorted(tok.special_token_ids)
    pools = (non_ascii_bytes, non_ascii_bytes, specials, range(tok.vocab_size))
    for _ in range(300):
        ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 12))]
        pieces, tail = _stream(tok, ids, skip_special_tokens)
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) + tail == expected, ids


def test_special_tokens_render_as_text_unless_skipped(tok):
    ids = tok.encode("<|im_start|>assistant\nhi 👋<|im_end|>")
    assert "".join(_stream(tok, ids)[0]) == "<|im_start|>assistant\nhi 👋<|im_end|>"
    assert "".join(_stream(tok, ids, skip_special_tokens=True)[0]) == "assistant\nhi 👋"


def test_logprob_token_text_and_bytes(tok):
    text = "hi 😀"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    assert detok.token_text(ids[0]) == "hi"
    assert b"".join(bytes(detok.token_bytes(i)) for i in ids) == text.encode("utf-8")
    partial = [i for i in ids if _is_partial_character(tok.token_bytes(i))]
    assert partial
    for i in partial:
        expected = "bytes:" + "".join(f"\\x{b:02x}" for b in tok.token_bytes(i))
        assert detok.token_text(i) == expected
