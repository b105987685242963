"""What the server holds: the `Serving` snapshot (the loaded model, its engine, its sticky
sampling settings), swapped whole by a model switch.

A request takes the snapshot once (`ServerState.use`) and holds it to its end; switching models
waits until no request holds one, so a reply never changes model half-way. The new model starts
from its default sampling settings.

A request may name a catalogue tag, the model the operator started the server with, or a
`.gguf` file in the operator's model directories, never a path: any other name is the same
404, whether or not a file of that name exists, and nothing is opened for it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from kiln.api.access import AccessPolicy
from kiln.api.metrics import Metrics
from kiln.cluster.options import ClusterOptions
from kiln.runtime.engine.bootstrap import EngineOptions, start_engine
from kiln.runtime.engine.client import EngineClient
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.fingerprint import system_fingerprint
from kiln.runtime.errors import ModelNotFoundError
from kiln.runtime.models.loader import ModelInfo
from kiln.runtime.sampling.settings import SamplingSettings
from kiln.runtime.store.catalogue import lookup
from kiln.runtime.store.gguf_file import ModelLoadError
from kiln.runtime.store.model_dirs import ModelDirs, default_models_dir
from kiln.runtime.store.weights_digest import weights_sha256

log = logging.getLogger("kiln")


@dataclass(frozen=True)
class ServeOptions:
    engine: EngineOptions = EngineOptions()
    per_request_sampling: bool = False  # the sticky settings are the API's business
    shutdown_timeout: float = 30.0  # SIGTERM: seconds running requests may still take
    max_request_bytes: int | None = None  # None: sized from the context (server.py)
    models_dirs: tuple[Path, ...] = field(default_factory=lambda: (default_models_dir(),))
    access: AccessPolicy = AccessPolicy()  # --api-key, --allowed-origins
    cluster: ClusterOptions | None = None  # --replicas: engines on Ray Serve (kiln.cluster)
    webui: bool = True  # the chat page at / (--no-webui: none)


@dataclass(frozen=True)
class ModelRef:
    """A model a client may name: `name` is what clients call it, `source` what the loader
    reads (a catalogue tag, or the path of an operator's file)."""

    name: str
    source: str
    path: Path | None = None  # a models-directory file


@dataclass(frozen=True)
class Serving:
    """What serves requests now: taken whole by a request, replaced whole by a switch."""

    ref: ModelRef
    model: ModelInfo
    engine: EngineClient
    settings: SamplingSettings
    fingerprint: str  # every reply's system_fingerprint (runtime/engine/fingerprint.py)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config


class ServerState:
    def __init__(self, options: ServeOptions):
        self.options = options
        self.model_dirs = ModelDirs(tuple(options.models_dirs))
        self.metrics = Metrics(lambda: s.engine.stats() if (s := self.serving) else None,
                               lambda: s.engine.routing_stats() if (s := self.serving) else None)
        self.serving: Serving | None = None
        self.startup: ModelRef | None = None  # the operator's model, from the command line
        self.in_flight = 0  # requests holding the snapshot
        self.draining = False  # SIGTERM received: new requests get a 503
        self._idle = asyncio.Event()
        self._idle.set()
        self._switch = asyncio.Lock()
        self.launch: Callable[[str], tuple[ModelInfo, EngineClient]]
        if options.cluster is not None:  # the same interface, over Ray Serve replicas
            from kiln.cluster.launch import ClusterLauncher

            self.launch = ClusterLauncher(options.engine, options.cluster)
        else:
            self.launch = partial(start_engine, options=options.engine)

    def start(self, model: str) -> None:
        """Load the command line's model: any tag or path (the operator's choice), which
        requests may name later too."""
        self.startup = ModelRef(model, model)
        self.load(self.startup)

    def load(self, ref: ModelRef) -> None:
        """Load (or reload) a model; blocking: call it from a worker thread when serving.

        The old engine is stopped only once the new model has loaded: a load that fails
        (not a GGUF, a failed pull) leaves the server serving the model it had.
        """
        model, engine = self.launch(ref.source)
        # A models-directory file is known by its file name.
        serving = Serving(ref, replace(model, name=ref.name), engine,
                          SamplingSettings(model.defaults,
                                           per_request=self.options.per_request_sampling),
                          system_fingerprint(weights_sha256(model.path, model.entry),
                                             engine.config.numerics))
        old, self.serving = self.serving, serving
        if old is not None:
            self.metrics.engine_retired(old.engine.stats())
            old.engine.shutdown()
        # What is loaded now lives as long as the model, so the collector need not walk it
        # (vLLM freezes its heap the same way): a full collection over the ~250k objects of
        # torch, the tokenizer and the engine pauses whichever thread allocates, the event
        # loop's too, 0.1 s on an idle core and several times that on one decoding shares.
        gc.unfreeze()  # the old model's objects: collectable again
        gc.collect()
        gc.freeze()
        config = engine.config
        log.info("[kiln]  Serving %s: context %d, prefill chunk %d, %d tokens a step, KV "
                 "cache %d tokens (%d blocks of %d)", ref.name, config.ctx_len,
                 config.prefill_chunk_len, config.token_budget,
                 config.num_blocks * config.block_size, config.num_blocks, config.block_size)

    def resolve(self, name: str) -> ModelRef:
        """The model a client's name means. Only a listing of the model directories is
        compared with it: no other name reaches the file system."""
        for ref in (self.serving and self.serving.ref, self.startup):
            if ref is not None and name == ref.name:
                return ref
        if lookup(name) is not None:
            return ModelRef(name, name)
        local = self.model_dirs.find(name)
        if local is not None:
            return ModelRef(local.name, str(local.path), local.path)
        raise ModelNotFoundError()

    def is_loaded(self, ref: ModelRef | None) -> bool:
        """Whether `ref` is the loaded model (None: whichever is loaded)."""
        loaded = self.serving and self.serving.model
        if ref is None or loaded is None:
            return ref is None
        if ref.name == loaded.name:
            return True
        try:  # the operator's file, started by its path and now named by the listing
            return ref.path is not None and ref.path.samefile(loaded.path)
        except OSError:
            return False

    async def ensure_model(self, name: str | None, reload: bool = False) -> None:
        """Make the model `name` means the loaded one, waiting for in-flight requests to
        finish first; no name means the loaded model.

        A request that arrives while a switch is under way waits for it, so it is never
        submitted to the engine being stopped.
        """
        ref = self.resolve(name) if name else None
        if not reload and self.is_loaded(ref) and not self._switch.locked():
            return
        async with self._switch:
            if not reload and self.is_loaded(ref):
                return
            await self._idle.wait()
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.load, ref)
            except ModelLoadError as exc:
                if ref.path is None:  # a catalogue tag or the operator's model: our failure
                    raise
                # An operator's file that kiln cannot read: no such model, for the client.
                log.warning("[kiln]  Model %s in the models directory: %s", ref.name,
                            exc.reason)
                raise ModelNotFoundError() from None

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
        if self.in_flight and self.serving is not None:
            log.info("[kiln]  Ending the %d requests still running", self.in_flight)
            self.serving.engine.abort_all(reason="shutdown")
            deadline = loop.time() + 5.0
            while self.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)

    @asynccontextmanager
    async def use(self, name: str | None) -> AsyncIterator[Serving]:
        """The snapshot serving the model `name` means (loading it first if need be), held
        until the request is done: a switch waits for it."""
        await self.ensure_model(name)
        serving = self.serving  # ensure_model returned with nothing awaited since: it is name's
        self.in_flight += 1
        self._idle.clear()
        try:
            yield serving
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
