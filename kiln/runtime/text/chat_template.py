"""Chat messages -> prompt text, with the model's own Jinja chat template.

Renders the way Hugging Face's `apply_chat_template(..., tokenize=False)` does (a sandboxed,
immutable Jinja environment with trim_blocks and lstrip_blocks, HF's `tojson`,
`raise_exception` and `strftime_now`), so a template written for transformers works unchanged.
The rendered text carries its own BOS: tokenize it with `add_special_tokens=False`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.runtime.text.tokenizer import gguf_reader

# A plain ChatML template, for a model whose GGUF carries none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Names a message's reasoning arrives under; templates read `reasoning_content` (gpt-oss's
# read `thinking`), so every one is filled from whichever the caller set.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateError(ValueError):
    """The chat template rejected these messages (its `raise_exception`) or failed on them.

    The message is the template's own words; the API answers it as a 400.
    """


class ChatTemplate:
    """One compiled chat template and the special tokens it may write."""

    def __init__(self, template_str: str, bos_token: str | None = None,
                 eos_token: str | None = None, **special_tokens: str | None) -> None:
        self.template_str = template_str
        # Like HF's special_tokens_map: a token the model lacks is left undefined (renders ""),
        # never the string "None".
        tokens = {"bos_token": bos_token, "eos_token": eos_token, **special_tokens}
        self.special_tokens = {name: text for name, text in tokens.items() if text is not None}
        try:
            self._template = _environment().from_string(template_str)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template does not parse (line {exc.lineno}): "
                                f"{exc.message}") from exc

    @classmethod
    def from_gguf(cls, path_or_reader, fallback: str | None = None) -> ChatTemplate:
        """The GGUF's `tokenizer.chat_template`, or `fallback` when it has none."""
        reader = gguf_reader(path_or_reader)
        fields = reader.fields

        def get(key: str):
            field = fields.get(key)
            return None if field is None else field.contents()

        template_str = get("tokenizer.chat_template") or fallback
        if template_str is None:
            raise ValueError("GGUF has no tokenizer.chat_template; pass a fallback template")
        tokens = fields["tokenizer.ggml.tokens"]
        special = {}
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
            token_id = get(f"tokenizer.ggml.{key}")
            if token_id is not None:
                special[name] = tokens.contents(token_id)
        return cls(template_str, **special)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra_kwargs: Any) -> str:
        """The prompt text for `messages` (dicts with "role", "content", ...).

        `extra_kwargs` (enable_thinking, reasoning_effort, documents, ...) reach the template as
        variables and override the special tokens of the same name. Raises TemplateError.
        """
        context = {
            **self.special_tokens, **extra_kwargs,
            "messages": [_normalize_message(message) for message in messages],
            "tools": None if tools is None else list(tools),
            "documents": extra_kwargs.get("documents"),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc
        except (TypeError, ValueError, LookupError, AttributeError) as exc:
            # e.g. `'...' + message['content']` when content is a list of parts
            raise TemplateError(f"chat template failed on these messages: {exc}") from exc


def _normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """As transformers does: drop keys set to None (OpenAI sends `content: null` next to
    tool_calls; templates test `is defined`), and alias the reasoning fields."""
    if not isinstance(message, Mapping):
        raise TemplateError(f"a chat message must be an object, got {type(message).__name__}")
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # HF's filter: unlike Jinja's own it leaves <, >, & and non-ASCII alone and takes json options.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so a template cannot reach Python internals."""

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in HF
    templates; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env

