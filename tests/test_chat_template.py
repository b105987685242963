"""kiln.runtime.text.chat_template against transformers' apply_chat_template on the same GGUF."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kiln.runtime.text.chat_template import CHATML_TEMPLATE, ChatTemplate, TemplateError  # noqa: E402
from kiln.runtime.text.tokenizer import Tokenizer  # noqa: E402

SINGLE_TURN = [{"role": "user", "content": "What is the capital of France?"}]
MULTI_TURN = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "Hi! Who are you?"},
    {"role": "assistant", "content": "I am a small model. 😀"},
    {"role": "user", "content": "Write   two\nlines, with <b>tags</b> & “quotes”."},
    {"role": "assistant", "content": "Line one.\nLine two."},
    {"role": "user", "content": "Thanks"},
]
CONVERSATIONS = {"single_user_turn": SINGLE_TURN, "system_and_multi_turn": MULTI_TURN}

# Exercises what a tool-calling, reasoning template uses: tojson with options, namespace,
# loop controls, `is defined` on keys sent as None, extra kwargs, and strftime_now.
TOOLS_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(n_tool_calls=0, first_user=none) -%}
{%- if tools -%}
<tools>{{ tools | tojson }}</tools>
<pretty>{{ tools[0] | tojson(indent=2, sort_keys=true) }}</pretty>
{% endif -%}
date: {{ strftime_now('%Y-%m-%d') }}
{% for message in messages %}
{%- if message.role == 'user' and ns.first_user is none -%}
{% set ns.first_user = loop.index %}
{%- endif %}
<|im_start|>{{ message.role }}
{% if message.reasoning_content is defined -%}
<think>{{ message.reasoning_content }}</think>
{%- endif %}
{%- if message.content is defined %}{{ message.content }}{% else %}(no content){% endif %}
{%- for call in message.tool_calls | default([]) %}
{%- if loop.index > 2 %}{% break %}{% endif %}
{%- set ns.n_tool_calls = ns.n_tool_calls + 1 %}
<tool_call>{{ call.function | tojson }}</tool_call>
{%- endfor %}<|im_end|>
{% endfor -%}
first user turn: {{ ns.first_user }}, tool calls: {{ ns.n_tool_calls }}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{%- if reasoning_effort is defined %}effort={{ reasoning_effort }}{% endif %}
{%- endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo <actuelle> & prévisions",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TOOL_MESSAGES = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "reasoning": "Need the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                      "arguments": {"city": "Zürich"}}}] * 3},
    {"role": "tool", "content": '{"temp_c": 21}'},
]


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf) -> Path:
    return Path(smollm2_gguf)


@pytest.fixture(scope="module")
def reader(gguf_path):
    from gguf import GGUFReader

    return GGUFReader(gguf_path)


@pytest.fixture(scope="module")
def template(gguf_path) -> ChatTemplate:
    return ChatTemplate.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def tok(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_render_matches_transformers(template, hf_tok, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    ours = template.render(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=False)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_tokenized_prompt_matches_transformers(template, tok, hf_tok, conversation,
                                               add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    ours = tok.encode(template.render(messages, add_generation_prompt=add_generation_prompt),
                      add_special_tokens=False)
    theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=False)
    assert ours == list(theirs)
    assert ours.count(tok.encode("<|im_start|>")[0]) == ours.count(tok.encode("<|im_end|>")[0]) \
        + add_generation_prompt


def test_generation_prompt_is_the_only_difference(template):
    with_prompt = template.render(MULTI_TURN, add_generation_prompt=True)
    without = template.render(MULTI_TURN, add_generation_prompt=False)
    assert with_prompt == without + "<|im_start|>assistant\n"


@pytest.mark.parametrize("extra", [{}, {"enable_thinking": False},
                                   {"enable_thinking": True, "reasoning_effort": "high"}])
def test_tools_template_matches_transformers(hf_tok, extra):
    template = ChatTemplate(TOOLS_TEMPLATE, bos_token=hf_tok.bos_token,
                            eos_token=hf_tok.eos_token)
    ours = template.render(TOOL_MESSAGES, tools=TOOLS, **extra)
    theirs = hf_tok.apply_chat_template(TOOL_MESSAGES, tools=TOOLS, chat_template=TOOLS_TEMPLATE,
                                        add_generation_prompt=True, tokenize=False, **extra)
    assert ours == theirs
    assert "Météo <actuelle> & prévisions" in ours  # HF's tojson escapes neither
    assert "(no content)" in ours and "<think>Need the tool.</think>" in ours
    assert "tool calls: 2" in ours  # {% break %} after two


def test_raise_exception_is_a_template_error_with_the_templates_message(hf_tok):
    source = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
              "{{ raise_exception('Only user and assistant roles are supported!') }}"
              "{% endif %}{{ m.content }}{% endfor %}")
    messages = [{"role": "system", "content": "x"}]
    with pytest.raises(TemplateError, match="^Only user and assistant roles are supported!$"):
        ChatTemplate(source).render(messages)
    with pytest.raises(Exception, match="^Only user and assistant roles are supported!$"):
        hf_tok.apply_chat_template(messages, chat_template=source, tokenize=False)
    assert issubclass(TemplateError, ValueError)


def test_a_template_that_does_not_parse_fails_when_built():
    with pytest.raises(TemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}{{ m.content }}")


def test_content_the_template_cannot_handle_is_a_template_error(template):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with pytest.raises(TemplateError, match="failed on these messages"):
        template.render(parts)


def test_template_cannot_reach_python_internals():
    with pytest.raises(TemplateError, match="'__class__' of 'list' object is unsafe"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="'_x' is not allowed"):
        ChatTemplate("{% set ns = namespace(_x=1) %}{{ ns._x }}").render([])
    with pytest.raises(TemplateError, match="'append' of 'list' object is unsafe"):  # immutable
        ChatTemplate("{{ messages.append(1) }}").render([])


def test_missing_special_tokens_render_empty_not_none():
    assert ChatTemplate("[{{ bos_token }}|{{ eos_token }}]").render([]) == "[|]"


def _write_gguf_without_template(path: Path) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["<s>", "</s>", "a"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_from_gguf_uses_the_fallback_only_without_a_template(tmp_path, reader):
    bare = _write_gguf_without_template(tmp_path / "bare.gguf")
    with pytest.raises(ValueError, match="no tokenizer.chat_template"):
        ChatTemplate.from_gguf(bare)
    fallback = ChatTemplate.from_gguf(bare, fallback="{{ bos_token }}" + CHATML_TEMPLATE)
    assert fallback.render(SINGLE_TURN, add_generation_prompt=False) == \
        "<s><|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    own = ChatTemplate.from_gguf(reader, fallback=CHATML_TEMPLATE)
    assert "You are a helpful AI assistant named SmolLM" in own.render(SINGLE_TURN)
