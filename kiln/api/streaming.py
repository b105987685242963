"""Sending a reply: one JSON body, or a stream of events (OpenAI's SSE, Ollama's NDJSON).

An error met once a stream has started cannot change the status line any more: it is sent
in-band, as the stream's own last event, and the stream still ends properly."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from sanic.response import json as sanic_json

from kiln.api.errors import InternalServerError, error_body


def json_response(body: dict, status: int = 200):
    return sanic_json(body, status=status)


async def send_sse(request, events: AsyncIterator[dict], done: bool = True,
                   event_name: Callable[[dict], str | None] | None = None):
    """`data: {...}` per event, `data: [DONE]` last (unless done=False: the Responses API
    ends with its own event). event_name, if given, adds an `event:` line per event."""
    response = await request.respond(content_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

    def frame(event: dict) -> str:
        name = event_name(event) if event_name else None
        head = f"event: {name}\n" if name else ""
        return f"{head}data: {json.dumps(event)}\n\n"

    try:
        async for event in events:
            await response.send(frame(event))
    except InternalServerError as exc:
        # Headers are gone already: report in-band, as OpenAI's streams do.
        await response.send(frame(error_body(exc)))
    if done:
        await response.send("data: [DONE]\n\n")
    await response.eof()
    return None


async def send_ndjson(request, events: AsyncIterator[dict]):
    """One JSON object per line (Ollama's streams); an error ends it as {"error": "..."}."""
    response = await request.respond(content_type="application/x-ndjson")
    try:
        async for event in events:
            await response.send(json.dumps(event) + "\n")
    except InternalServerError as exc:
        await response.send(json.dumps({"error": exc.message}) + "\n")
    await response.eof()
    return None
