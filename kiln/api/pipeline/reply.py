"""Writing a reply, for every route alike: one driver takes a request's generations and the
route's `ReplyShape`, and sends either the shape's whole body (one JSON object) or its events
as they come (OpenAI's SSE, Ollama's NDJSON). A streamed reply and a whole one are the same
events, fed the same deltas, so they always agree.

An error met once a stream has started cannot change the status line any more: the shape
turns it into the stream's own last events, and the stream still ends properly.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from sanic.response import json as sanic_json

from kiln.api.pipeline.admission import Generation, interleave
from kiln.api.pipeline.assembler import Delta
from kiln.runtime.errors import KilnError, RequestFailedError
from kiln.runtime.text.tools import ToolCall

log = logging.getLogger("kiln")


class ReplyShape(Protocol):
    """How one endpoint writes a reply. Streamed: `start`, then `feed` per delta, then
    `finish` (or `fail`, for an error after the start) give the events. Whole: the deltas are
    fed, `finish` called and `body` sent."""

    framing: str  # "sse" (with [DONE] last), "sse-named" (an event line each), "ndjson"

    def start(self) -> list[dict]: ...

    def feed(self, choice: int, delta: Delta) -> list[dict]: ...

    def finish(self) -> list[dict]: ...

    def fail(self, exc: KilnError) -> list[dict]: ...

    def body(self) -> dict: ...


def json_response(body: dict, status: int = 200):
    return sanic_json(body, status=status)


async def send_reply(request, gens: list[Generation], shape: ReplyShape, stream: bool):
    if not stream:
        async for i, d in interleave(gens):
            shape.feed(i, d)
        shape.finish()
        return json_response(shape.body())
    return await send_events(request, reply_events(gens, shape), shape.framing)


async def reply_events(gens: list[Generation], shape: ReplyShape) -> AsyncIterator[dict]:
    """Every event of a streamed reply; a failure after the start ends it in-band, never
    with a hang or a cut connection."""
    for event in shape.start():
        yield event
    try:
        async for i, d in interleave(gens):
            for event in shape.feed(i, d):
                yield event
        final = shape.finish()
    except KilnError as exc:  # an engine abort, a replica lost
        final = shape.fail(exc)
    except Exception as exc:  # a bug: logged with its traceback, reported by request id
        log.error("[kiln]  Internal error in request %s", gens[0].request_id, exc_info=exc)
        final = shape.fail(RequestFailedError(gens[0].request_id))
    for event in final:
        yield event


async def send_events(request, events: AsyncIterator[dict], framing: str):
    """SSE (`data: {...}` each, `data: [DONE]` last, or with an `event:` line each and no
    [DONE]: the Responses API's) or NDJSON (one object per line: Ollama's)."""
    ndjson = framing == "ndjson"
    response = await request.respond(
        content_type="application/x-ndjson" if ndjson else "text/event-stream",
        headers=None if ndjson else {"Cache-Control": "no-cache"})
    async for event in events:
        if ndjson:
            frame = json.dumps(event) + "\n"
        else:
            head = f"event: {event['type']}\n" if framing == "sse-named" else ""
            frame = f"{head}data: {json.dumps(event)}\n\n"
        await response.send(frame)
    if framing == "sse":
        await response.send("data: [DONE]\n\n")
    await response.eof()
    return None


@dataclass
class ChoiceText:
    """One choice's reply, collected from its deltas (for a whole body)."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    calls: dict[int, list] = field(default_factory=dict)  # index -> [id, name, arguments]
    finish_reason: str | None = None

    def feed(self, d: Delta) -> None:
        self.content.append(d.content)
        self.reasoning.append(d.reasoning)
        self.logprobs += d.logprobs
        for c in d.tool_calls:
            call = self.calls.setdefault(c.index, [c.id, c.name, ""])
            call[2] += c.arguments
        self.finish_reason = d.finish_reason or self.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(*self.calls[i]) for i in sorted(self.calls)]
