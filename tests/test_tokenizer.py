"""kiln.runtime.text.tokenizer against transformers loading the same GGUF (AutoTokenizer,
gguf_file=)."""

import os
import random
from dataclasses import replace
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kiln.runtime.text.tokenizer import GGUFVocab, Tokenizer  # noqa: E402

ASCII = [
    "Hello world", "hello world", "Hello, world!", "The quick brown fox jumps over the lazy dog.",
    "a", "I", "x y z", "HELLO WORLD", "CamelCaseWord", "snake_case_word", "kebab-case-word",
    "don't", "I'm", "they'll", "we've", "you're", "he'd", "it's", "'s", "DON'T", "I'M HERE",
    "e.g. i.e. etc.", "(parenthesised) [bracketed] {braced}", "!!!???...", "a-b_c.d,e;f:g",
    "email@example.com", "https://example.com/path?query=1&x=2#frag", "C:\\Users\\name",
    "What is 2+2?", "#hashtag @mention $dollar %percent ^caret &amp *star", "~`|\\/<>",
]
UNICODE = [
    "café", "naïve façade", "Ελληνικά γράμματα", "Русский текст", "中文字符测试",
    "日本語のテキスト",
    "한국어 문장", "العربية", "עברית", "हिन्दी", "ภาษาไทย", "Tiếng Việt", "Ærøskøbing", "straße",
    "e\u0301", "ﬁ ligature", "non\u00a0breaking", "zero\u200bwidth", "\ufeffBOM", "º°±µ¶·",
    "ℕ ⊂ ℤ ⊂ ℚ ⊂ ℝ", "∀x∈ℝ: x²≥0", "→ ← ↑ ↓", "“smart quotes” ‘single’", "em—dash en–dash…",
    "\u0000nul", "\x7fdel", "\x1b[31mred\x1b[0m", "\U0001d54f\U0001d550", "ｆｕｌｌｗｉｄｔｈ",
]
EMOJI = [
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷🇯🇵", "❤️", "🤖 robots", "I ❤ NY", "🔥🔥🔥", "a😀b", " 🎉 ",
    "emoji at end 🚀", "🧑🏿‍🚀", "🏳️‍🌈", "©®™", "☃", "😀😃😄😁😆😅😂🤣",
]
WHITESPACE = [
    " leading", "trailing ", "  two leading", "trailing two  ", "a  b", "a   b", "a    b",
    " ", "  ", "   ", "\n", "\n\n", "\n\n\n", "\t", "\t\tx", "\r\n", "a\r\nb", " \n ", "a \n b",
    "line one\nline two\n", "\n leading newline", "x\n\n\ny", "tab\tseparated\tvalues",
    "mixed \t \n whitespace", "    indented", "a  1", "a\n1", "end with newline\n", "\u3000ideo",
]
DIGITS = [
    "0", "7", "42", "123", "1234", "12345", "1234567890", "3.14159", "1,000,000", "2024-06-01",
    "-42", "+7", "1e10", "6.022e23", "0x1F", "0b1011", "v1.2.3", "99.9%", "$1,234.56",
    "12:30:45", "1/2", "³⁄₄", "٣٤٥", "123abc456", "abc123def", " 123", "x 1 2 3",
    "31415926535897932384626433832795028841971693993751058209749445923078164062862",
    "In 2023, 1.5 million people paid 20 dollars.",
]
CODE = [
    "def f(x):\n    return x * 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "import numpy as np\nx = np.arange(10)[::2]",
    '{"key": "value", "n": [1, 2, 3], "ok": true, "nil": null}',
    "<div class=\"a\"><p>Hello</p></div>",
    "SELECT * FROM users WHERE id = 42;",
    "#!/bin/bash\nset -euo pipefail\necho \"$HOME\"",
    "x = lambda a, b: a if a > b else b  # comment",
    "fn main() { println!(\"{}\", 1 + 2); }",
    "    if (x == nullptr) return -1;",
    "```python\nprint('hi')\n```",
    "a += 1; b -= 2; c *= 3; d /= 4; e **= 5; f //= 6",
    "git commit -m \"fix: a bug\" && git push",
    "^\\d{3}-\\d{4}$",
    "<?xml version=\"1.0\"?>",
]
SPECIAL = [
    "<|im_start|>user\nhi<|im_end|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "<|im_end|><|im_end|>", "x<|endoftext|>y", " <|im_start|> ", "<|im_start|>assistant\n",
    "<repo_name>kiln<file_sep>main.py", "<|im_start|>system\nBe brief.<|im_end|>\n",
    "<|IM_END|>", "<|im_end|", "<|im_start", "im_end|>", "<<|im_end|>>", "<|im_end|>\n\n",
    "text <jupyter_code>print(1)<jupyter_output>1<empty_output>",
]
CATEGORIES = {"ascii": ASCII, "unicode": UNICODE, "emoji": EMOJI, "whitespace": WHITESPACE,
              "digits": DIGITS, "code": CODE, "special": SPECIAL}


def _mixed_strings(count: int) -> list[str]:
    """Random joins of the strings above, so category boundaries meet every separator."""
    rng = random.Random(1234)
    pool = [s for strings in CATEGORIES.values() for s in strings]
    separators = ["", " ", "  ", "\n", "\t", " \n"]
    return [rng.choice(separators).join(rng.choice(pool) for _ in range(rng.randint(2, 4)))
            for _ in range(count)]


CATEGORIES["mixed"] = _mixed_strings(150)
ALL_STRINGS = [s for strings in CATEGORIES.values() for s in strings]


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf) -> Path:
    return Path(smollm2_gguf)


@pytest.fixture(scope="module")
def reader(gguf_path):
    from gguf import GGUFReader

    return GGUFReader(gguf_path)


@pytest.fixture(scope="module")
def tok(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _first_mismatch(strings, ours, theirs):
    for s in strings:
        a, b = ours(s), theirs(s)
        if a != b:
            return f"{s!r}: kiln {a} != transformers {b}"
    return None


@pytest.mark.parametrize("category", list(CATEGORIES))
def test_encode_matches_transformers(tok, hf_tok, category):
    strings = CATEGORIES[category]
    mismatch = _first_mismatch(strings, tok.encode, lambda s: hf_tok(s)["input_ids"])
    assert mismatch is None, mismatch


def test_parity_covers_a_few_hundred_strings():
    assert len(ALL_STRINGS) >= 300


def test_decode_round_trips_and_matches_transformers(tok, hf_tok):
    for s in ALL_STRINGS:
        ids = tok.encode(s)
        assert tok.decode(ids) == s, f"{s!r} does not round-trip"
        assert tok.decode(ids) == hf_tok.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == \
            hf_tok.decode(ids, skip_special_tokens=True), f"{s!r} with skip_special_tokens"


def test_special_tokens_inline_encode_as_one_id(tok):
    im_start, im_end = tok.encode("<|im_start|>"), tok.encode("<|im_end|>")
    assert im_start == [1] and im_end == [2]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids[1:-1]) == "user\nhi"
    assert len(tok.encode("<|IM_END|>")) > 1  # only the exact spelling is special
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_special_token_ids_match_transformers(tok, hf_tok):
    theirs = {i for i, added in hf_tok.added_tokens_decoder.items() if added.special}
    assert tok.special_token_ids == theirs
    assert tok.bos_token == hf_tok.bos_token and tok.bos_token_id == hf_tok.bos_token_id
    assert tok.eos_token == hf_tok.eos_token and tok.eos_token_id == hf_tok.eos_token_id


def test_smollm2_adds_no_bos_like_transformers(tok, hf_tok):
    assert tok.add_bos is False
    assert tok.encode("hi") == hf_tok("hi")["input_ids"] == tok.encode("hi", False)


def test_stop_token_ids_are_eos_and_end_of_turn(tok):
    assert tok.eos_token_id in tok.stop_token_ids
    assert tok.encode("<|im_end|>")[0] in tok.stop_token_ids
    assert tok.stop_token_ids == {tok.encode("<|im_end|>")[0], tok.encode("<|endoftext|>")[0]}


def test_id_to_token_matches_transformers_for_every_id(tok, hf_tok):
    theirs = hf_tok.convert_ids_to_tokens(list(range(tok.vocab_size)))
    assert tok.vocab_size == len(hf_tok) == 49152
    assert [tok.id_to_token(i) for i in range(tok.vocab_size)] == theirs


def test_token_bytes_join_to_decoded_text(tok):
    for s in ALL_STRINGS:
        ids = tok.encode(s)
        assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == tok.decode(ids)
    assert tok.token_bytes(tok.encode(" ")[0]) == b" "
    assert tok.token_bytes(tok.encode("\n")[0]) == b"\n"


def test_vocab_for_grammar_matches_xgrammar_from_transformers(tok, hf_tok):
    xgr = pytest.importorskip("xgrammar")
    vocab = tok.vocab_for_grammar()
    ours = xgr.TokenizerInfo(vocab.encoded_vocab, xgr.VocabType[vocab.vocab_type],
                             vocab_size=vocab.vocab_size, stop_token_ids=vocab.stop_token_ids,
                             add_prefix_space=vocab.add_prefix_space)
    theirs = xgr.TokenizerInfo.from_huggingface(hf_tok)
    assert ours.vocab_type == theirs.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert ours.vocab_size == theirs.vocab_size
    assert ours.add_prefix_space == theirs.add_prefix_space
    assert [bytes(b) for b in ours.decoded_vocab] == [bytes(b) for b in theirs.decoded_vocab]
    assert [bytes(b) for b in ours.decoded_vocab] == \
        [tok.token_bytes(i) for i in range(tok.vocab_size)]
    assert set(ours.stop_token_ids) == tok.stop_token_ids


def test_from_gguf_accepts_an_open_reader(reader, tok):
    shared = Tokenizer.from_gguf(reader)
    assert shared.encode("<|im_start|>user\nhé 😀<|im_end|>") == \
        tok.encode("<|im_start|>user\nhé 😀<|im_end|>")


def test_unsupported_tokenizer_model_is_named_in_the_error(reader):
    vocab = replace(GGUFVocab.from_gguf(reader), model="bert")
    with pytest.raises(ValueError, match="'bert' is not supported"):
        Tokenizer(vocab)


# --- a variant of the file, to reach the paths SmolLM2 itself does not take ----------------

HELLO_ID = 28120  # "hello", marked user-defined in the variant
MISLABELLED_ID = 3  # "<repo_name>", renamed "<repo name>": a control token outside the alphabet


def write_vocab_variant(src: Path, dst: Path) -> Path:
    """SmolLM2's vocabulary without tensors, with add_bos_token set, one user-defined token,
    one control token spelled outside the byte alphabet, and no chat template."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    writer = GGUFWriter(dst, arch="llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "tokenizer.chat_template"):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.add_bos_token":
            value = True
        elif key == "tokenizer.ggml.tokens":
            value[MISLABELLED_ID] = "<repo name>"
        elif key == "tokenizer.ggml.token_type":
            value[HELLO_ID] = 4
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, field.types[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def variant_path(gguf_path, tmp_path_factory) -> Path:
    return write_vocab_variant(gguf_path, tmp_path_factory.mktemp("gguf") / "variant.gguf")


def test_variant_matches_transformers(variant_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(variant_path.parent), gguf_file=variant_path.name)
    tok = Tokenizer.from_gguf(variant_path)
    strings = ["hello", "xhelloy", "say hello", "<repo name>", "<|im_start|>hi",
               "Hello hello HELLO", "<repo_name>", *SPECIAL, *ASCII]
    mismatch = _first_mismatch(strings, tok.encode, lambda s: hf(s)["input_ids"])
    assert mismatch is None, mismatch
    mismatch = _first_mismatch(strings, lambda s: tok.encode(s, add_special_tokens=False),
                               lambda s: hf(s, add_special_tokens=False)["input_ids"])
    assert mismatch is None, mismatch
    assert tok.add_bos and tok.encode("hi")[0] == tok.bos_token_id
    assert tok.encode("xhelloy") == [tok.bos_token_id, *tok.encode("x", False), HELLO_ID,
                                     *tok.encode("y", False)]
    assert MISLABELLED_ID not in tok.special_token_ids
    assert tok.token_bytes(MISLABELLED_ID) == b"<repo name>"
    assert tok.decode([MISLABELLED_ID, HELLO_ID]) == hf.decode([MISLABELLED_ID, HELLO_ID])


def test_pre_tokenizer_regexes_are_the_ones_transformers_uses():
    """Files other than SmolLM2's (Llama 3, Qwen 2) split text with these; no such file here,
    so compare the table itself."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from kiln.runtime.text.tokenizer import _PRE_TOKENIZER_SPLITS

    for name, regex in _PRE_TOKENIZER_SPLITS.items():
        assert mapping.GGUF_PRE_TOKENIZER_SPLITS.get(name) == regex, name
    assert "smollm" not in mapping.GGUF_PRE_TOKENIZER_SPLITS  # so it gets GPT-2's regex
