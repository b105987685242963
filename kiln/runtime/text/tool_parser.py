"""Tool calls read back out of a model's text as it streams: `ToolCallParser` turns text
deltas into content and tool-call deltas; `parse_tool_calls`, for a whole reply, is the same
parser fed all of it, so both agree."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from kiln.runtime.text.tools import ToolCall, ToolCallFormat, arguments_text


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCallDelta:
    """One stream delta of call `index`: the first carries id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


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
            self._arguments(out, call, arguments_text(args))
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
