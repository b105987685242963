"""Work too heavy for the event loop, whose every other request and stream (and /health) waits
while it runs: decoding a large body, rendering and tokenizing a prompt, decoding token ids. It
runs on the loop's worker threads: the tokenizer lets the loop run while it works, and Python
work yields to it every few milliseconds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from kiln.api.protocol.fields import load_json_body

T = TypeVar("T")
SMALL_BODY = 64 << 10  # bytes: read on the loop, where a thread hop would cost more


async def off_loop(fn: Callable[..., T], *args) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def read_body(request, parse: Callable[[dict], T] = dict) -> T:
    """The request's JSON body (a 400 unless an object), read into a dialect's request by
    `parse`: off the loop when it is large."""
    raw = request.body
    if len(raw) < SMALL_BODY:
        return parse(load_json_body(raw))
    return await off_loop(lambda: parse(load_json_body(raw)))
