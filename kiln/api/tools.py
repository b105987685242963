"""Tools and structured output on the API side: what a chat request's `tools`, `tool_choice`,
`parallel_tool_calls` and `response_format` mean for the loaded model, and the tool calls
read back out of its text.

How a model family writes calls is one `ToolCallFormat` (SMOLLM2, HERMES). SmolLM2's GGUF chat
template ignores `tools` (so does Gemma 3's fallback), so kiln describes the tools itself in
a system message (`tool_messages`), in the format the family was trained on, and renders earlier
calls and tool results into plain message text. A template that reads `tools` renders them itself.

`plan_tools` decides, per request: the grammar (`tool_choice` "required" or a named function:
the reply must be calls of the allowed tools, in the family's format; otherwise
`response_format`), and whether the reply is parsed for calls ("auto": free text, calls found
afterwards). `ToolCallParser` turns text deltas into content and OpenAI tool-call deltas; the
non-streaming `parse_tool_calls` is the same parser fed the whole text, so both agree.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from kiln.api.protocol import ChatCompletionRequest, ToolCall, ToolChoice, ToolSpec
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.sampling.grammar import MAX_TOOL_CALL_WHITESPACE, GrammarSpec

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
            calls = [(c["function"]["name"], _arguments_text(c["function"]["arguments"]))
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


def _arguments_text(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


# --- the request: checks, grammar, parsing plan ---------------------------------------------

_TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


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


def plan_tools(req: ChatCompletionRequest, fmt: ToolCallFormat) -> ToolPlan:
    """Checks what api/protocol.py leaves open and decides grammar and parsing; raises
    InvalidRequestError naming the field."""
    seen = set()
    for i, t in enumerate(req.tools):
        if not _TOOL_NAME.fullmatch(t.name):
            raise InvalidRequestError(
                f"Invalid 'tools[{i}].function.name': {t.name!r}. Names may use letters, "
                "digits, '_', '-', '.' and ':', up to 64 characters.",
                param=f"tools[{i}].function.name", code="invalid_value")
        if t.name in seen:
            raise InvalidRequestError(f"Duplicate tool name {t.name!r} in 'tools'.",
                                      param=f"tools[{i}].function.name", code="invalid_value")
        seen.add(t.name)
    choice = req.tool_choice or ToolChoice("auto" if req.tools else "none")
    tools = req.tools if choice.mode != "none" else ()
    max_calls = 1 if choice.mode == "function" or req.parallel_tool_calls is False else None
    grammar = None
    if choice.mode in ("required", "function") and tools:
        forced = [t for t in tools if choice.mode == "required" or t.name == choice.name]
        grammar = tool_call_grammar(forced, fmt, max_calls)
    elif req.response_format is not None and req.response_format.type == "json_object":
        grammar = GrammarSpec("json_object")
    elif req.response_format is not None and req.response_format.type == "json_schema":
        grammar = GrammarSpec.json_schema(req.response_format.schema or {})
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


# --- reading calls back out of the text -----------------------------------------------------


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def tool_call_json(call: ToolCall) -> dict:
    """A complete call, as `choices[0].message.tool_calls[i]`."""
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


@dataclass
class ToolCallDelta:
    """One stream delta of call `index`: the first carries id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_json(self) -> dict:
        """As `choices[0].delta.tool_calls[i]` in a stream chunk."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class _Call:
    index: int
    id: str
    name: str
    arguments: str = ""


# The start of a call object whose arguments can stream: name first, then an object or array.
_STREAMABLE_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*[\[{]\Z')
_TEXT, _BLOCK, _OBJECT, _JUNK = range(4)


class ToolCallParser:
    """Text deltas in; content and tool-call deltas out. Ordinary text passes through as
    content (a possible start marker is held back); a block of calls becomes calls. A call's
    arguments stream as they arrive when it is written name first with an object for arguments
    (always so under the tool grammar); any other call is emitted whole once its JSON closes.
    A block that holds no valid call of a known tool is given back as content."""

    def __init__(self, fmt: ToolCallFormat, tool_names: set[str] | None = None,
                 max_calls: int | None = None) -> None:
        self.fmt, self.tool_names, self.max_calls = fmt, tool_names, max_calls
        self._blocks = ((fmt.start, fmt.end),) + fmt.loose_blocks
        self._end = fmt.end  # the end marker of the block being read
        self.calls: list[_Call] = []
        self.content = ""  # all content so far
        self._buf = ""  # text not yet consumed
        self._state = _TEXT
        self._after_block = False  # whitespace right after a block of calls is dropped
        self._block_raw = ""  # the current block's text, to give back as content
        self._block_calls = 0
        self._obj = ""  # the call object being read, and its JSON scanner state
        self._depth, self._in_str, self._esc = 0, False, False
        self._call: _Call | None = None  # the call whose arguments stream
        self._decided = False
        self._args_start = self._args_end = self._sent = 0

    # -- public --

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while self._buf and self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        """End of the reply: flush what was held back."""
        out = ParsedDelta()
        rest, self._buf = self._buf, ""
        if self._state == _TEXT:
            self._text(rest, out)
        elif self._block_calls == 0 and self._call is None:  # an unfinished block, no call
            self._after_block = False
            self._text(self._block_raw + rest, out)
        self._state = _TEXT
        return out

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in self.calls]

    # -- states --

    def _step(self, out: ParsedDelta) -> bool:
        """Consume from the buffer; False when it must wait for more text."""
        f, buf = self.fmt, self._buf
        if self._state == _TEXT:
            found = [(i, start, end) for start, end in self._blocks
                     if (i := buf.find(start)) >= 0]
            if not found:
                keep = max(_partial_suffix(buf, start) for start, _ in self._blocks)
                self._text(buf[:len(buf) - keep], out)
                self._buf = buf[len(buf) - keep:]
                return False
            i, start, self._end = min(found)
            self._text(buf[:i], out)
            self._open_block(start)
            self._buf = buf[i + len(start):]
            return True
        if self._state == _BLOCK:
            c = buf[0]
            if c in " \t\r\n,[]":
                self._consume(1)
            elif c == "{":
                self._state, self._obj, self._decided, self._call = _OBJECT, "", False, None
                self._depth, self._in_str, self._esc = 0, False, False
            elif buf.startswith(self._end):
                self._consume(len(self._end))
                self._close_block(out)
            elif buf.startswith(f.start):  # a new block without closing this one
                self._consume(len(f.start))
            elif self._end.startswith(buf) or f.start.startswith(buf):
                return False
            else:
                self._state = _JUNK
            return True
        if self._state == _OBJECT:
            return self._scan_object(out)
        i = buf.find(self._end)  # _JUNK: skip to the end of the block
        if i < 0:
            keep = _partial_suffix(buf, self._end)
            self._consume(len(buf) - keep)
            return False
        self._consume(i + len(self._end))
        self._close_block(out)
        return True

    def _text(self, text: str, out: ParsedDelta) -> None:
        if self._after_block:
            stripped = text.lstrip()
            if not stripped:
                return
            text, self._after_block = stripped, False
        out.content += text
        self.content += text

    def _consume(self, n: int) -> None:
        self._block_raw += self._buf[:n]
        self._buf = self._buf[n:]

    def _open_block(self, marker: str) -> None:
        self._state, self._block_raw, self._block_calls = _BLOCK, marker, 0

    def _close_block(self, out: ParsedDelta) -> None:
        self._state = _TEXT
        if self._block_calls:
            self._after_block = True
        else:  # nothing usable in it: it was text after all
            self._after_block = False
            self._text(self._block_raw, out)

    def _scan_object(self, out: ParsedDelta) -> bool:
        """Read the call object's JSON up to its closing brace, streaming its arguments."""
        obj, done, n = self._obj, False, 0
        while n < len(self._buf) and not done:
            c = self._buf[n]
            n += 1
            obj += c
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
                if self._depth == 2 and not self._decided:
                    self._decided = True
                    self._start_streaming(obj, out)
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1 and self._call is not None and not self._args_end:
                    self._args_end = len(obj)
                done = self._depth <= 0
        self._obj = obj
        self._block_raw += self._buf[:n]
        self._buf = self._buf[n:]
        if self._call is not None:
            end = self._args_end or len(obj)
            self._arguments(out, self._call, obj[self._sent:end])
            self._sent = end
        if done:
            self._end_object(out)
        return done

    def _start_streaming(self, obj: str, out: ParsedDelta) -> None:
        m = _STREAMABLE_HEAD.match(obj)
        if m is None:
            return
        name = json.loads(f'"{m.group(1)}"')
        if not self._wanted(name):
            return
        self._call = self._new_call(name, out)
        self._args_start = self._sent = len(obj) - 1
        self._args_end = 0

    def _end_object(self, out: ParsedDelta) -> None:
        self._state = _BLOCK
        if self._call is not None:
            self._block_calls += 1
            self._call = None
            return
        try:
            parsed = json.loads(self._obj)
        except ValueError:
            parsed = None
        name = parsed.get("name") if isinstance(parsed, dict) else None
        if isinstance(name, str) and self._wanted(name):
            args = parsed.get("arguments", parsed.get("parameters", {}))
            call = self._new_call(name, out)
            self._arguments(out, call, _arguments_text(args))
            self._block_calls += 1
        elif self._block_calls == 0:
            self._state = _JUNK  # give the block back as text when it closes

    def _wanted(self, name: str) -> bool:
        known = self.tool_names is None or name in self.tool_names
        return known and (self.max_calls is None or len(self.calls) < self.max_calls)

    def _new_call(self, name: str, out: ParsedDelta) -> _Call:
        call = _Call(len(self.calls), new_call_id(), name)
        self.calls.append(call)
        out.tool_calls.append(ToolCallDelta(call.index, "", call.id, name))
        return call

    def _arguments(self, out: ParsedDelta, call: _Call, text: str) -> None:
        if not text:
            return
        call.arguments += text
        if out.tool_calls and out.tool_calls[-1].index == call.index:
            out.tool_calls[-1].arguments += text
        else:
            out.tool_calls.append(ToolCallDelta(call.index, text))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str, fmt: ToolCallFormat, tool_names: set[str] | None = None,
                     max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply: the streaming parser fed all of it at once."""
    parser = ToolCallParser(fmt, tool_names, max_calls)
    parser.feed(text)
    parser.finish()
    return parser.content, parser.tool_calls
