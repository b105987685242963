"""continue_final_message: cut the rendered chat right after the final message's text.

The cut is Hugging Face's `apply_chat_template(continue_final_message=True)` as
request-parameters.md describes it (transformers' chat_template_utils, the rule vLLM runs):
render the chat with no generation prompt, find the LAST occurrence of the final message's
stripped text, and stop right after it. Whitespace: if the template kept the text exactly as
sent (so its trailing whitespace is there), the cut keeps the trailing whitespace; otherwise
(the template trimmed it, or the text also starts with whitespace) the cut is right after the
stripped text. So "The answer is: " under a trimming template is read as "The answer is:".

Newer transformers releases locate the message with a sentinel instead, and keep the trailing
whitespace of a text that also starts with whitespace when the template preserves it; kiln
follows the documented rule above.

request-parameters.md also lists templates whose finished message differs from their reply
opening (Qwen3.5's empty think block, Gemma4's thought channel, LFM2.5-Thinking), where the
text is put after the reply's opening instead. kiln ships none of those templates, so there
is no such exception here.
"""

from __future__ import annotations

from kiln.runtime.errors import InvalidRequestError


def continuation_prompt(rendered: str, final_text: str) -> str:
    """The prompt to continue `final_text` (the last assistant message, as sent) from.

    `rendered` is the whole chat rendered with add_generation_prompt=False.
    Raises InvalidRequestError(param="continue_final_message") when the template does not
    reproduce the text, or there is no text to continue.
    """
    stripped = final_text.strip()
    if not stripped:
        # HF would return the whole rendered chat (a finished turn): refuse instead.
        raise InvalidRequestError(
            "continue_final_message is true but the final assistant message has no text "
            "to continue.", param="continue_final_message")
    loc = rendered.rfind(stripped)
    if loc < 0:
        raise InvalidRequestError(
            "continue_final_message is true but the final message does not appear in the "
            "chat after applying the chat template (the template changes its text).",
            param="continue_final_message")
    lstripped = final_text.lstrip()
    if rendered[loc:loc + len(lstripped)] == final_text:
        # The template preserves spacing, or the text has none at its ends.
        return rendered[:loc + len(lstripped)]
    # The template trimmed trailing whitespace, or the text also starts with whitespace.
    return rendered[:loc + len(stripped)]
