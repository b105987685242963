"""The Responses API's output: a chat reply's deltas become output items (`reasoning`,
`message`, `function_call`) and the stream's events.

One `ResponseBuilder` per request serves both shapes: a stream sends the events that `start`,
`feed` and `finish` return, as they come; a plain request feeds every delta, drops the events
and sends the finished `response`. So a streamed reply and a plain one always agree.

An item is open while its deltas arrive and is closed (its `.done` events) when another kind
of item starts or the reply ends; the reply's end decides the closing status: a reply cut by
`max_output_tokens` leaves its last item, and the response, "incomplete".
"""

from __future__ import annotations

import copy
import secrets
import time
from dataclasses import dataclass, field

from kiln.api.pipeline.assembler import Delta
from kiln.api.protocol.responses import ResponsesRequest
from kiln.runtime.sampling.params import SamplingParams
from kiln.runtime.text.tool_parser import ToolCallDelta

# The chat finish_reason -> (the response's status, incomplete_details.reason).
_STATUS = {"stop": ("completed", None), "tool_calls": ("completed", None),
           "length": ("incomplete", "max_output_tokens"),
           "abort": ("incomplete", None)}  # the server shut down mid-reply


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def new_response(req: ResponsesRequest, response_id: str, model: str,
                 sampling: SamplingParams) -> dict:
    """The Response object before any output, echoing the request's settings; `sampling` is
    the request's admitted snapshot (the sticky values it actually runs with)."""
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "status": "in_progress", "background": False, "error": None,
        "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "max_tool_calls": None, "model": model,
        "output": [], "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": {"effort": sampling.reasoning_effort, "summary": None},
        "store": req.store, "temperature": sampling.temperature,
        "text": {"format": req.text_format}, "tool_choice": req.tool_choice,
        "tools": list(req.tools), "top_logprobs": req.chat.options.logprobs or 0,
        "top_p": sampling.top_p, "truncation": "disabled", "usage": None,
        "user": req.chat.user, "metadata": req.metadata,
    }


@dataclass
class _Item:
    """An output item being written: its place in `output` and its text so far."""

    index: int
    item: dict
    text: list[str] = field(default_factory=list)  # text, reasoning or arguments
    logprobs: list[dict] = field(default_factory=list)


class ResponseBuilder:
    def __init__(self, response: dict) -> None:
        self.response = response
        self.sequence_number = 0
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}  # the tool call's index in the reply -> its item
        self.pending_logprobs: list[dict] = []  # tokens with no text yet (a split character)
        self.finish_reason: str | None = None

    # -- the reply's life cycle --

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def feed(self, d: Delta) -> list[dict]:
        events = []
        if d.reasoning:
            events += self._reasoning(d.reasoning)
        if d.logprobs and not d.reasoning:
            self.pending_logprobs += d.logprobs
        if d.content:
            events += self._text(d.content)
        for call in d.tool_calls:
            events += self._call(call)
        self.finish_reason = d.finish_reason or self.finish_reason
        return events

    def finish(self, usage: dict) -> list[dict]:
        """The last events: the open item closed, then response.completed (or .incomplete)."""
        status, reason = _STATUS.get(self.finish_reason, ("completed", None))
        events = [] if self.response["output"] else self._open_message()  # an empty answer
        events += self._close("completed" if status == "completed" else "incomplete")
        self.response.update(status=status, usage=usage, completed_at=int(time.time()),
                             incomplete_details={"reason": reason} if reason else None)
        return events + [self._event(f"response.{status}", response=self._snapshot())]

    def fail(self, message: str) -> list[dict]:
        """The stream's end when the reply failed after it started: an `error` event, then
        response.failed with what was written so far."""
        if self.open is not None:
            self._fill(self.open, "incomplete")
            self.open = None
        self.response.update(status="failed",
                             error={"code": "server_error", "message": message})
        return [self._event("error", code="server_error", message=message, param=None),
                self._event("response.failed", response=self._snapshot())]

    # -- items --

    def _text(self, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open.item["type"] != "message":
            events += self._close("completed") + self._open_message()
        it, logprobs = self.open, self.pending_logprobs
        self.pending_logprobs = []
        it.text.append(text)
        it.logprobs += logprobs
        return events + [self._event("response.output_text.delta", item_id=it.item["id"],
                                     output_index=it.index, content_index=0, delta=text,
                                     logprobs=logprobs)]

    def _reasoning(self, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open.item["type"] != "reasoning":
            events += self._close("completed")
            events += self._open({"id": item_id("rs"), "type": "reasoning", "summary": [],
                                  "content": [], "status": "in_progress"},
                                 {"type": "reasoning_text", "text": ""})
        it = self.open
        it.text.append(text)
        return events + [self._event("response.reasoning_text.delta", item_id=it.item["id"],
                                     output_index=it.index, content_index=0, delta=text)]

    def _call(self, call: ToolCallDelta) -> list[dict]:
        events = []
        if call.id is not None:  # a new call: its first delta carries id and name
            events += self._close("completed")
            events += self._open({"id": item_id("fc"), "type": "function_call",
                                  "status": "in_progress", "call_id": call.id,
                                  "name": call.name, "arguments": ""})
            self.calls[call.index] = self.open
        it = self.calls[call.index]
        if call.arguments:
            it.text.append(call.arguments)
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=it.item["id"], output_index=it.index,
                                      delta=call.arguments))
        return events

    def _open_message(self) -> list[dict]:
        return self._open({"id": item_id("msg"), "type": "message", "status": "in_progress",
                           "role": "assistant", "content": []}, _output_text("", []))

    def _open(self, item: dict, part: dict | None = None) -> list[dict]:
        self.open = _Item(len(self.response["output"]), item)
        self.response["output"].append(item)
        events = [self._event("response.output_item.added", output_index=self.open.index,
                              item=copy.deepcopy(item))]
        if part is not None:
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=self.open.index, content_index=0,
                                      part=part))
        return events

    def _close(self, status: str) -> list[dict]:
        it, self.open = self.open, None
        if it is None:
            return []
        self._fill(it, status)
        item, where = it.item, {"item_id": it.item["id"], "output_index": it.index}
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", **where, content_index=0,
                                   text=part["text"], logprobs=part["logprobs"]),
                       self._event("response.content_part.done", **where, content_index=0,
                                   part=part)]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events += [self._event("response.reasoning_text.done", **where, content_index=0,
                                   text=part["text"]),
                       self._event("response.content_part.done", **where, content_index=0,
                                   part=part)]
        else:
            events.append(self._event("response.function_call_arguments.done", **where,
                                      name=item["name"], arguments=item["arguments"]))
        events.append(self._event("response.output_item.done", output_index=it.index,
                                  item=copy.deepcopy(item)))
        return events

    @staticmethod
    def _fill(it: _Item, status: str) -> None:
        """Write an item's text so far into the item itself."""
        text, item = "".join(it.text), it.item
        if item["type"] == "message":
            item["content"] = [_output_text(text, it.logprobs)]
        elif item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
        else:
            item["arguments"] = text
        item["status"] = status

    # -- events --

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _snapshot(self) -> dict:
        return copy.deepcopy(self.response)


def _output_text(text: str, logprobs: list[dict]) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
