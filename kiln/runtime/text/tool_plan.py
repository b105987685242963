"""What one chat request's `tools`, `tool_choice`, `parallel_tool_calls` and `response_format`
mean for the loaded model: the grammar its reply must match (`tool_choice` "required" or a named
function: calls of the allowed tools only, in the family's format; otherwise the response
format's), and whether the reply is read for calls ("auto": free text, calls found in it)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kiln.runtime.sampling.grammar import MAX_TOOL_CALL_WHITESPACE, GrammarSpec
from kiln.runtime.text.tool_parser import ToolCallParser
from kiln.runtime.text.tools import ToolCallFormat, ToolChoice, ToolSpec


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one chat request's tools and response_format mean for the loaded model."""

    format: ToolCallFormat
    choice: ToolChoice  # the effective choice: "none" without tools, "auto" with them
    prompt_tools: tuple[ToolSpec, ...]  # described to the model; () for "none"
    grammar: GrammarSpec | None  # compile with GrammarCompilerCache.get, off the event loop
    parse_calls: bool  # read the reply's calls out of its text
    max_calls: int | None  # 1: parallel_tool_calls false, or a named function

    def parser(self) -> ToolCallParser | None:
        if not self.parse_calls:
            return None
        return ToolCallParser(self.format, tool_names={t.name for t in self.prompt_tools},
                              max_calls=self.max_calls)


def plan_tools(fmt: ToolCallFormat, tools: tuple[ToolSpec, ...], choice: ToolChoice | None,
               parallel_tool_calls: bool | None, response_grammar: GrammarSpec | None
               ) -> ToolPlan:
    """tools are checked already (names unique and well formed: api/protocol)."""
    choice = choice or ToolChoice("auto" if tools else "none")
    tools = tools if choice.mode != "none" else ()
    max_calls = 1 if choice.mode == "function" or parallel_tool_calls is False else None
    grammar = response_grammar
    if choice.mode in ("required", "function") and tools:
        forced = [t for t in tools if choice.mode == "required" or t.name == choice.name]
        grammar = tool_call_grammar(forced, fmt, max_calls)
    parse = bool(tools) and (grammar is None or grammar.kind == "structural_tag")
    return ToolPlan(fmt, choice, tools, grammar, parse, max_calls)


def tool_call_grammar(tools: list[ToolSpec], fmt: ToolCallFormat,
                      max_calls: int | None) -> GrammarSpec:
    """The reply is one or more calls (at most `max_calls`) of `tools`, nothing else; each
    call's arguments match its tool's parameters schema (an object when it has none)."""
    def tag(t: ToolSpec, begin: str, end: str) -> dict:
        return {"type": "tag", "begin": begin + fmt.call_head(t.name), "end": "}" + end,
                "content": {"type": "json_schema",
                            "json_schema": t.parameters or {"type": "object"},
                            "max_whitespace_cnt": MAX_TOOL_CALL_WHITESPACE}}

    one = max_calls == 1
    if fmt.calls_per_block:
        calls = {"type": "tags_with_separator", "separator": fmt.calls_sep,
                 "tags": [tag(t, "", "") for t in tools],
                 "at_least_one": True, "stop_after_first": one}
        body = {"type": "sequence", "elements": [
            {"type": "const_string", "value": fmt.start + fmt.calls_open}, calls,
            {"type": "const_string", "value": fmt.calls_close + fmt.end}]}
    else:
        body = {"type": "tags_with_separator", "separator": fmt.calls_sep,
                "tags": [tag(t, fmt.start + fmt.calls_open, fmt.calls_close + fmt.end)
                         for t in tools],
                "at_least_one": True, "stop_after_first": one}
    return GrammarSpec("structural_tag",
                       json.dumps({"type": "structural_tag", "format": body}, ensure_ascii=False),
                       param="tools")


