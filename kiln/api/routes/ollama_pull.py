"""Ollama's /api/pull on kiln's own pull (runtime/store/pull.py): a catalogue tag is fetched
into the kiln cache, and its progress told as Ollama tells it, one NDJSON object each:

    {"status": "pulling manifest"}
    {"status": "pulling b179c9523d0e", "digest": "sha256:...", "total": N, "completed": n}
    {"status": "verifying sha256 digest"}
    {"status": "writing manifest"}
    {"status": "success"}

A model already in the cache is checked against its sha256 (and fetched again if it fails).
With `stream: false` the answer is the last object alone. An unknown tag is a 404 before
anything starts; a failed download ends the stream with {"error": "..."} (with stream false,
a 502). One pull of a tag runs at a time: a second request follows the one under way.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from kiln.api.errors import UpstreamError
from kiln.api.pipeline.reply import json_response, send_events
from kiln.api.pipeline.workers import read_body
from kiln.api.protocol.fields import invalid_type
from kiln.api.protocol.ollama import model_name
from kiln.runtime.errors import ModelNotFoundError
from kiln.runtime.store.catalogue import CatalogueEntry, lookup
from kiln.runtime.store.pull import PullError, is_pulled, model_path
from kiln.runtime.store.pull import pull as pull_model

log = logging.getLogger("kiln")


async def pull(request):
    body = await read_body(request)
    name = model_name(body)
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise invalid_type("stream", "a boolean", stream)
    entry = lookup(name)
    if entry is None:
        raise ModelNotFoundError()
    events = _events(entry, request.app.ctx.ollama_pulls)
    if stream:
        return await send_events(request, events, "ndjson")
    last = None
    async for last in events:
        if "error" in last:
            raise UpstreamError(last["error"])
    return json_response(last)


async def _events(entry: CatalogueEntry, running: dict[str, Pull]) -> AsyncIterator[dict]:
    digest = f"sha256:{entry.sha256}"

    def progress(completed: int) -> dict:
        return {"status": f"pulling {entry.sha256[:12]}", "digest": digest,
                "total": entry.size, "completed": completed}

    yield {"status": "pulling manifest"}
    job = running.get(entry.tag)
    if job is None and is_pulled(entry) and await asyncio.get_running_loop().run_in_executor(
            None, _sha256, model_path(entry)) == entry.sha256:
        yield progress(entry.size)
    else:
        job = running.get(entry.tag)  # (one may have started while the file was read)
        if job is None:
            job = running[entry.tag] = Pull.start(entry)
            job.done.add_done_callback(lambda _: running.pop(entry.tag, None))
        try:
            async for completed in job.progress():
                yield progress(completed)
        except PullError as exc:
            yield {"error": str(exc)}
            return
    yield {"status": "verifying sha256 digest"}  # (kiln's pull checked it as it wrote)
    yield {"status": "writing manifest"}
    yield {"status": "success"}


@dataclass
class Pull:
    """One pull under way, on a worker thread. It is not the request's: a client that leaves
    does not stop it, and another request for the tag follows it instead of starting one."""

    done: asyncio.Future
    completed: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def start(cls, entry: CatalogueEntry) -> Pull:
        loop = asyncio.get_running_loop()

        def report(completed: int) -> None:  # on the worker thread
            loop.call_soon_threadsafe(job.advance, completed)

        def run() -> None:
            log.info("[kiln]  Pulling %s", entry.tag)
            try:
                pull_model(entry, quiet=True, progress=report)
            except PullError as exc:
                log.warning("[kiln]  Pull of %s failed: %s", entry.tag, exc)
                raise
            log.info("[kiln]  Pulled %s", entry.tag)

        job = cls(loop.run_in_executor(None, run))
        job.done.add_done_callback(lambda _: job.changed.set())
        return job

    def advance(self, completed: int) -> None:
        self.completed = completed
        self.changed.set()

    async def progress(self) -> AsyncIterator[int]:
        """Bytes written, each time it grows, until the pull ends (raising its PullError)."""
        sent = -1
        while True:
            await self.changed.wait()
            self.changed.clear()
            if self.completed != sent:
                sent = self.completed
                yield sent
            if self.done.done():
                self.done.result()
                return


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
