"""What the server holds: the loaded model, its engine, its sticky sampling settings.

Switching models waits until no request is in flight, so a reply never changes model
half-way; the new model starts from its default sampling settings.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from kiln.cluster.options import ClusterOptions
from kiln.runtime.engine.bootstrap import EngineOptions, build_engine
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.llm_engine import AsyncEngine
from kiln.runtime.errors import ModelNotFoundError
from kiln.runtime.models.loader import LoadedModel
from kiln.runtime.sampling.settings import SamplingSettings
from kiln.runtime.store.catalogue import lookup
from kiln.runtime.store.gguf_file import ModelLoadError
from kiln.runtime.store.pull import local_file

log = logging.getLogger("kiln")


@dataclass(frozen=True)
class ServeOptions:
    engine: EngineOptions = EngineOptions()
    per_request_sampling: bool = False  # the sticky settings are the API's business
    shutdown_timeout: float = 30.0  # SIGTERM: seconds running requests may still take
    cluster: ClusterOptions | None = None  # --replicas: engines on Ray Serve (kiln.cluster)


class ServerState:
    def __init__(self, options: ServeOptions):
        self.options = options
        self.loaded: LoadedModel | None = None
        self.engine: AsyncEngine | None = None
        self.settings: SamplingSettings | None = None
        self.config: EngineConfig | None = None
        self.in_flight = 0
        self.draining = False  # SIGTERM received: new requests get a 503
        self._idle = asyncio.Event()
        self._idle.set()
        self._switch = asyncio.Lock()

    def load(self, name: str) -> None:
        """Load (or reload) a model; blocking: call it from a worker thread when serving.

        The old engine is stopped only once the new model has loaded: a load that fails
        (not a GGUF, a failed pull) leaves the server serving the model it had.
        """
        if self.options.cluster is not None:  # the same interface, over Ray Serve replicas
            from kiln.cluster.launch import start_cluster

            loaded, engine = start_cluster(name, self.options.engine, self.options.cluster,
                                           previous=self.engine)
        else:
            loaded, engine = build_engine(name, self.options.engine)
        if self.engine is not None:
            self.engine.shutdown()
        self.loaded, self.config = loaded, engine.config
        self.engine = engine if self.options.cluster is not None else AsyncEngine(engine)
        self.settings = SamplingSettings(loaded.defaults,
                                         per_request=self.options.per_request_sampling)
        config = self.config
        log.info("[kiln]  Serving %s: context %d, prefill chunk %d, KV cache %d tokens "
                 "(%d blocks of %d)", name, config.ctx_len, config.prefill_chunk_len,
                 config.num_blocks * config.block_size, config.num_blocks, config.block_size)

    def is_loaded(self, name: str | None) -> bool:
        if not name or self.loaded is None:
            return True
        return name == self.loaded.name or str(self.loaded.path) == name \
            or (lookup(name) is not None and lookup(name).filename == self.loaded.path.name
                and lookup(self.loaded.name) is not None)

    async def ensure_model(self, name: str | None, reload: bool = False) -> None:
        """Make `name` the loaded model, waiting for in-flight requests to finish first.

        A request that arrives while a switch is under way waits for it, so it is never
        submitted to the engine being stopped.
        """
        if not reload and self.is_loaded(name) and not self._switch.locked():
            return
        if name and lookup(name) is None and local_file(name) is None:
            raise ModelNotFoundError(name)
        async with self._switch:
            if not reload and self.is_loaded(name):
                return
            await self._idle.wait()
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.load, name)
            except ModelLoadError:
                if lookup(name) is not None:
                    raise
                # A local file that is not a GGUF kiln reads: no such model, for the client.
                log.warning("[kiln]  Request for model %r: not a loadable GGUF", name)
                raise ModelNotFoundError(name) from None

    async def drain(self) -> None:
        """On SIGTERM: take no new request, give the running ones up to --shutdown-timeout
        to finish, then end each that is left (finish_reason "abort", its stream closed
        as any other) and wait for their last bytes to go out."""
        self.draining = True
        loop = asyncio.get_running_loop()
        timeout = self.options.shutdown_timeout
        log.info("[kiln]  Shutting down: %d requests in flight, waiting up to %.0f s for them",
                 self.in_flight, timeout)
        deadline = loop.time() + timeout
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight and self.engine is not None:
            log.info("[kiln]  Ending the %d requests still running", self.in_flight)
            self.engine.abort_all(reason="shutdown")
            deadline = loop.time() + 5.0
            while self.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)

    def begin(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def end(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()
