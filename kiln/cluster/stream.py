"""One request's outputs from a replica: a RequestStream (runtime/engine/client.py).

A pump task reads the replica's stream (a Serve DeploymentResponseGenerator) into a queue,
so an abort from the ingress can end the stream at once, as the engine would: a last output
with finish_reason "abort", while the remote call is cancelled (which aborts the request on
its replica). A replica that dies before the first output gets the request again on another
(nothing of it was sent yet); one that dies later ends the stream with an error, never a
hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import ReplicaUnavailableError

from kiln.runtime.engine.request import RequestOutput
from kiln.runtime.errors import RequestFailedError

log = logging.getLogger("kiln")

REPLICA_LOST = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)


@dataclass(frozen=True, slots=True)
class StreamFailed:
    """Put in the queue in place of an output: the stream ends with this error."""

    detail: str


class ClusterStream:
    def __init__(self, request_id: str, num_prompt_tokens: int, send: Callable,
                 on_first: Callable[[str, RequestOutput], None], on_end: Callable[[str], None],
                 retries: int = 1):
        """send(): a new remote call of this request (a DeploymentResponseGenerator);
        on_first(replica_id, output): its first output (routing counters); on_end(request_id):
        it is over, whichever way."""
        self.request_id, self.num_prompt_tokens = request_id, num_prompt_tokens
        self.send, self.on_first, self.on_end = send, on_first, on_end
        self.retries = retries
        self.arrival = time.monotonic()
        self.queue: asyncio.Queue[RequestOutput | StreamFailed] = asyncio.Queue()
        self.last: RequestOutput | None = None
        self.first_token_time: float | None = None
        self.replica_id: str | None = None
        self.finished = self.aborted = False
        self.response = send()
        self.pump = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        try:
            while True:
                try:
                    async for chunk in self.response:
                        for out in chunk.outputs:
                            if self.replica_id is None:
                                self.replica_id = chunk.replica_id
                                self.on_first(chunk.replica_id, out)
                            self.queue.put_nowait(self._local_times(out))
                    return
                except REPLICA_LOST as exc:
                    if self.aborted:
                        return
                    if self.replica_id is None and self.retries > 0:
                        self.retries -= 1
                        log.warning("[kiln]  Request %s: its replica was lost before its first "
                                    "output (%s); sending it again", self.request_id,
                                    type(exc).__name__)
                        self.response = self.send()
                        continue
                    self.queue.put_nowait(StreamFailed(
                        f"The engine replica serving it stopped ({type(exc).__name__})."))
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug on the replica: its traceback is in its log
            if self.aborted:  # Serve's RequestCancelledError: the abort reached the call
                return
            log.error("[kiln]  Request %s failed on replica %s: %r", self.request_id,
                      self.replica_id, exc)
            self.queue.put_nowait(StreamFailed("The engine replica failed."))
        finally:
            self.on_end(self.request_id)  # (again from the reader: on_end is idempotent)

    def _local_times(self, out: RequestOutput) -> RequestOutput:
        """Times on this process's clock, as the client sees them: arrival when the ingress
        took the request, the first token when it got here (the usage block subtracts them
        from times taken here; the replica may be another machine, with its own clock)."""
        if out.first_token_time is not None and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        return replace(out, arrival_time=self.arrival, first_token_time=self.first_token_time)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, StreamFailed):
                    self.finished = True
                    raise RequestFailedError(self.request_id, item.detail)
                self.last = item
                yield item
                if item.finished:
                    self.finished = True
                    return
        finally:
            if not self.finished:
                self.abort()
            self.on_end(self.request_id)

    def abort(self) -> None:
        """End the request now: cancel the remote call, and end the stream as the engine
        ends an aborted request (a last output, finish_reason "abort")."""
        if self.finished or self.aborted:
            return
        self.aborted = True
        self.pump.cancel()
        self.response.cancel()
        last = self.last
        self.queue.put_nowait(RequestOutput(
            request_id=self.request_id, new_token_ids=[], new_logprobs=None, finished=True,
            finish_reason="abort",
            num_prompt_tokens=last.num_prompt_tokens if last else self.num_prompt_tokens,
            num_cached_tokens=last.num_cached_tokens if last else 0,
            num_output_tokens=last.num_output_tokens if last else 0,
            first_token_time=last.first_token_time if last else None,
            arrival_time=self.arrival))
