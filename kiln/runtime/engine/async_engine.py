"""The local engine as the API uses it (an `EngineClient`): `LLMEngine` on a thread of its own,
each request's outputs an async stream. Requests and aborts reach the thread through an inbox
drained between steps."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.engine_request import EngineRequest
from kiln.runtime.engine.llm_engine import LLMEngine
from kiln.runtime.engine.request import RequestOutput
from kiln.runtime.engine.stats import EngineStats, RoutingStats
from kiln.runtime.sampling.grammar import GrammarSpec

log = logging.getLogger("kiln")


class OutputStream:
    """One request's outputs, as an async iterator; leaving it early aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str):
        self.engine, self.request_id = engine, request_id
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.finished = False

    def put(self, output: RequestOutput) -> None:  # called from the engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, output)
        except RuntimeError:  # the server's loop is closed: no one is reading any more
            pass

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                out = await self.queue.get()
                yield out
                if out.finished:
                    self.finished = True
                    return
        finally:
            if not self.finished:
                self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, OutputStream] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self._thread.start()

    # --- EngineClient: what the API asks; reads of what the engine thread writes are fine
    # from any thread (a snapshot may be a step old) ---

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def routing_stats(self) -> RoutingStats | None:
        return None  # one engine routes nothing

    def health(self) -> dict:
        return {}

    async def check_grammar(self, spec: GrammarSpec, prefix: str = "") -> None:
        await asyncio.get_running_loop().run_in_executor(
            None, self.engine.grammars.check, spec, prefix)

    async def add_request(self, request_id: str, request: EngineRequest) -> OutputStream:
        """Validates now (raising before any stream starts) and returns the output stream; a
        grammar is compiled off the event loop."""
        if request.grammar is None:
            req = self.engine.make_request(request_id, request)
        else:
            req = await asyncio.get_running_loop().run_in_executor(
                None, self.engine.make_request, request_id, request)
        stream = OutputStream(self, request_id)
        self.streams[request_id] = stream
        self.inbox.put(("add", req))
        return stream

    def abort(self, request_id: str, reason: str = "client gone") -> None:
        self.inbox.put(("abort", (request_id, reason)))

    def abort_all(self, reason: str) -> None:
        for request_id in list(self.streams):
            self.abort(request_id, reason)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._stop = True
        self.inbox.put(("noop", None))
        self._thread.join(timeout=5)

    # --- the engine thread ---

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, arg = self.inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self.engine.add_request(arg)
            elif kind == "abort":
                request_id, reason = arg
                out = self.engine.abort(request_id)
                stream = self.streams.pop(request_id, None)
                if out is not None:
                    log.info("[kiln]  Aborted request %s (%s) after %d tokens",
                             request_id, reason, out.num_output_tokens)
                    if stream is not None:
                        stream.put(out)

    def _loop(self) -> None:
        while not self._stop:
            # Wait for the inbox when there is nothing to step, or nothing the scheduler
            # can place: stepping again would spin on the same answer.
            self._drain_inbox(block=not self.engine.has_unfinished() or self.engine.stalled)
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception:
                log.exception("[kiln]  Engine step failed; aborting the running requests")
                outputs = [o for r in list(self.engine.requests)
                           if (o := self.engine.abort(r)) is not None]
            for out in outputs:
                stream = self.streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
                    if out.finished:
                        self.streams.pop(out.request_id, None)
