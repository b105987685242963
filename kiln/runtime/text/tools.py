"""A chat's tools as text: what a tool and a call are, how each model family writes calls
(`ToolCallFormat`: SMOLLM2, HERMES), and the prompt that describes the tools to a model whose
chat template ignores them.

SmolLM2's GGUF chat template ignores `tools` (so does Gemma 3's fallback), so kiln describes the
tools itself in a system message (`tool_messages`), in the format the family was trained on,
and renders earlier calls and tool results into plain message text. A template that reads
`tools` renders them itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str | None
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: dict  # JSON schema of the arguments; {} when not sent
    strict: bool | None = None

    def to_template(self) -> dict:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "function"
    name: str | None = None  # mode "function": the tool that must be called


# --- model families ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How one model family writes tool calls.

    A reply's calls are, with `calls_per_block` True (SmolLM2: a JSON array in one block):
        start + calls_open + call + calls_sep + call ... + calls_close + end
    and with it False (Hermes: one block per call, blocks separated by calls_sep):
        start + calls_open + call + calls_close + end + calls_sep + start + ...
    where call = {"name": "NAME", "arguments": {...}}. `system_prompt` has a {tools} slot.
    """

    name: str
    calls_open: str
    calls_sep: str
    calls_close: str
    calls_per_block: bool
    system_prompt: str
    tools_as_list: bool  # {tools}: one JSON array (True) or one tool per line (False)
    start: str = "<tool_call>"
    end: str = "</tool_call>"
    tool_result_role: str = "user"
    tool_result_open: str = "<tool_response>\n"
    tool_result_close: str = "\n</tool_response>"
    # Other (start, end) pairs a model of the family writes calls in when not forced: small
    # Qwen models often answer a call as a fenced JSON block, which llama.cpp's Hermes parser
    # also reads. A block holding no valid call of a known tool stays content.
    loose_blocks: tuple[tuple[str, str], ...] = ()

    def call_head(self, name: str) -> str:
        return '{"name": "' + name + '", "arguments": '

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """(name, arguments JSON text) pairs as the model writes them."""
        objs = [self.call_head(name) + args + "}" for name, args in calls]
        if self.calls_per_block:
            return self.start + self.calls_open + self.calls_sep.join(objs) + \
                self.calls_close + self.end
        return self.calls_sep.join(self.start + self.calls_open + o + self.calls_close + self.end
                                   for o in objs)


# SmolLM2 was tuned on calls as one JSON array in a <tool_call> block, described by a system
# prompt listing the tools in <tools>; this is that prompt in kiln's words.
SMOLLM2 = ToolCallFormat(
    name="smollm2", calls_open="[\n", calls_sep=",\n", calls_close="\n]", calls_per_block=True,
    tools_as_list=True,
    system_prompt=(
        "You are an expert in composing functions. You are given a question and a set of "
        "possible functions. Based on the question, you may need to make one or more "
        "function/tool calls to achieve the purpose.\n"
        "You have access to the following tools:\n<tools>{tools}</tools>\n"
        "To call tools, answer with the calls only, in this format:\n"
        '<tool_call>[\n{"name": "func_name1", "arguments": {"argument1": "value1", '
        '"argument2": "value2"}},\n(more tool calls as required)\n]</tool_call>\n'
        "If no tool is needed, answer the question directly."))

# Hermes 2 Pro / Qwen 2.5 style, the common ChatML convention: the default for other families.
HERMES = ToolCallFormat(
    name="hermes", calls_open="\n", calls_sep="\n", calls_close="\n", calls_per_block=False,
    tools_as_list=False,
    system_prompt=(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n{tools}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>"),
    loose_blocks=(("```json\n", "```"),))


def tool_format_for(model_name: str) -> ToolCallFormat:
    """The family format for a model tag or GGUF path (Hermes unless known otherwise)."""
    return SMOLLM2 if "smollm2" in model_name.lower() else HERMES


def template_handles_tools(template_str: str) -> bool:
    """Whether a chat template reads `tools` (then it describes them itself)."""
    return re.search(r"\btools\b", template_str) is not None


def tool_messages(messages: list[dict], tools: tuple[ToolSpec, ...],
                  fmt: ToolCallFormat) -> list[dict]:
    """Template messages (`ChatMessage.to_template()` dicts) for a template that ignores tools:
    the tools described in the system message, earlier calls and tool results as text."""
    out = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [(c["function"]["name"], arguments_text(c["function"]["arguments"]))
                     for c in m.pop("tool_calls")]
            text = m.get("content") or ""
            m["content"] = text + ("\n" if text else "") + fmt.render_calls(calls)
        elif m["role"] == "tool":
            m = {"role": fmt.tool_result_role,
                 "content": fmt.tool_result_open + (m.get("content") or "") +
                 fmt.tool_result_close}
        elif m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if tools:
        specs = [t.to_template() for t in tools]
        listed = json.dumps(specs, ensure_ascii=False) if fmt.tools_as_list else \
            "\n".join(json.dumps(s, ensure_ascii=False) for s in specs)
        prompt = fmt.system_prompt.replace("{tools}", listed)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def arguments_text(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
