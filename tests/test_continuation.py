"""continue_final_message's prompt cut, against hand-rendered strings and transformers itself."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kiln.api.errors import http_status
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.store.catalogue import GEMMA_CHAT_TEMPLATE
from kiln.runtime.text.continuation import continuation_prompt

# A template that writes content exactly as sent, and one that trims it (like Gemma's).
PLAIN = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TRIMMED = PLAIN.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
UPPER = PLAIN.replace("{{ m['content'] }}", "{{ m['content'] | upper }}")


def test_the_cut_is_right_after_the_final_text():
    rendered = "<|user|>\nIs it?<|end|>\n<|assistant|>\nThe answer is:<|end|>\n"
    assert continuation_prompt(rendered, "The answer is:") == (
        "<|user|>\nIs it?<|end|>\n<|assistant|>\nThe answer is:")


def test_trailing_whitespace_is_kept_when_the_template_kept_it():
    rendered = "<|assistant|>\nThe answer is: <|end|>\n"
    assert continuation_prompt(rendered, "The answer is: ") == "<|assistant|>\nThe answer is: "


def test_trailing_whitespace_is_dropped_when_the_template_trimmed_it():
    rendered = "<|assistant|>\nThe answer is:<|end|>\n"
    assert continuation_prompt(rendered, "The answer is: ") == "<|assistant|>\nThe answer is:"


def test_leading_whitespace_makes_the_trailing_whitespace_go_too():
    # request-parameters.md: "unless your text also starts with whitespace (Hugging Face
    # drops the trailing space then too)" -- even though this template kept it.
    rendered = "<|assistant|>\n The answer is: <|end|>\n"
    assert continuation_prompt(rendered, " The answer is: ") == "<|assistant|>\n The answer is:"


def test_leading_whitespace_alone_changes_nothing():
    rendered = "<|assistant|>\n  Yes<|end|>\n"
    assert continuation_prompt(rendered, "  Yes") == "<|assistant|>\n  Yes"


def test_the_last_occurrence_of_the_text_is_used():
    rendered = ("<|user|>\nSay: Paris is<|end|>\n<|assistant|>\nParis is<|end|>\n"
                "<|user|>\nAgain<|end|>\n<|assistant|>\nParis is<|end|>\n")
    assert continuation_prompt(rendered, "Paris is") == rendered[:-len("<|end|>\n")]


def test_inner_whitespace_and_newlines_are_part_of_the_text():
    rendered = "<|assistant|>\nLine 1\n\n  Line 2\t<|end|>\n"
    assert continuation_prompt(rendered, "Line 1\n\n  Line 2\t") == (
        "<|assistant|>\nLine 1\n\n  Line 2\t")


def test_a_template_that_changes_the_text_is_a_400():
    with pytest.raises(InvalidRequestError) as e:
        continuation_prompt("<|assistant|>\nTHE ANSWER IS:<|end|>\n", "The answer is:")
    assert e.value.param == "continue_final_message" and http_status(e.value) == 400


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_a_final_message_without_text_is_a_400(text):
    with pytest.raises(InvalidRequestError) as e:
        continuation_prompt("<|assistant|>\n<|end|>\n", text)
    assert e.value.param == "continue_final_message"


# --- transformers' apply_chat_template(continue_final_message=True) as the oracle ---

@pytest.fixture(scope="module")
def hf_tokenizer():
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<bos>": 1}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        bos_token="<bos>", unk_token="<unk>")


def hf_pair(tok, template, messages):
    """(kiln's cut of the plain render, transformers' own continue_final_message render)."""
    rendered = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=False)
    ours = continuation_prompt(rendered, messages[-1]["content"])
    theirs = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                     continue_final_message=True)
    return ours, theirs


def chat(final):
    return [{"role": "system", "content": "Answer yes or no."},
            {"role": "user", "content": "Is Paris the capital of France?"},
            {"role": "assistant", "content": final}]


ORACLE_CASES = ["The answer is:", "The answer is: ", "The answer is:\n\n", " Yes", "\nYes",
                "Line 1\n  Line 2", "Is Paris", "a"]


@pytest.mark.parametrize("template", [PLAIN, TRIMMED, CHATML, GEMMA_CHAT_TEMPLATE],
                         ids=["plain", "trimmed", "chatml", "gemma"])
@pytest.mark.parametrize("final", ORACLE_CASES)
def test_the_cut_matches_transformers(hf_tokenizer, template, final):
    ours, theirs = hf_pair(hf_tokenizer, template, chat(final))
    assert ours == theirs


@pytest.mark.parametrize("template", [TRIMMED, GEMMA_CHAT_TEMPLATE], ids=["trimmed", "gemma"])
def test_leading_and_trailing_whitespace_under_a_trimming_template_match_transformers(
        hf_tokenizer, template):
    ours, theirs = hf_pair(hf_tokenizer, template, chat(" The answer is: "))
    assert ours == theirs and ours.endswith("The answer is:")


def test_transformers_also_refuses_a_template_that_changes_the_text(hf_tokenizer):
    with pytest.raises(ValueError):
        hf_tokenizer.apply_chat_template(chat("The answer is:"), chat_template=UPPER,
                                         tokenize=False, continue_final_message=True)
    rendered = hf_tokenizer.apply_chat_template(chat("The answer is:"), chat_template=UPPER,
                                                tokenize=False)
    with pytest.raises(InvalidRequestError):
        continuation_prompt(rendered, "The answer is:")


TEXT = st.text(alphabet="xyz .:\n\t", min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(final=TEXT, template=st.sampled_from([PLAIN, TRIMMED, CHATML]))
def test_any_text_cut_matches_transformers(hf_tokenizer, final, template):
    assume(final.strip())
    # Newer transformers releases keep the trailing whitespace of a text that also starts
    # with whitespace; kiln follows the documented rule (see test above), so skip those.
    assume(not (final[0].isspace() and final[-1].isspace()))
    ours, theirs = hf_pair(hf_tokenizer, template, chat(final))
    assert ours == theirs
