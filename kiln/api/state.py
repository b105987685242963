"""What the server holds: the loaded model, its engine, its sticky sampling settings.

Switching models waits until no request is in flight, so a reply never changes model
half-way; the new model starts from its default sampling settings.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.runtime.catalogue import lookup
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import AsyncEngine, LLMEngine
from kiln.runtime.errors import ModelNotFoundError
from kiln.runtime.model_loader import LoadedModel, load_model
from kiln.runtime.sampling_settings import SamplingSettings

log = logging.getLogger("kiln")


@dataclass(frozen=True)
class ServeOptions:
    ctx_len: int | None = None
    prefill_chunk_len: int | None = None
    kv_cache_tokens: int | None = None
    max_num_seqs: int = 64
    per_request_sampling: bool = False
    dtype: str = "float32"  # or bfloat16: oneDNN's bf16 products (runtime/backends/cpu/bf16.py)


class ServerState:
    def __init__(self, options: ServeOptions):
        self.options = options
        self.loaded: LoadedModel | None = None
        self.engine: AsyncEngine | None = None
        self.settings: SamplingSettings | None = None
        self.config: EngineConfig | None = None
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._switch = asyncio.Lock()

    def load(self, name: str) -> None:
        """Load (or reload) a model; blocking: call it from a worker thread when serving.

        The old engine is stopped only once the new model has loaded: a load that fails
        (not a GGUF, a failed pull) leaves the server serving the model it had.
        """
        cuda = torch.cuda.is_available()
        o = self.options
        loaded = load_model(name, device="cuda" if cuda else "cpu", use_triton=cuda,
                            dtype=getattr(torch, o.dtype))
        config = EngineConfig.build(
            loaded.ctx_len, loaded.max_prefill_len, ctx_len=o.ctx_len,
            prefill_chunk_len=o.prefill_chunk_len, kv_cache_tokens=o.kv_cache_tokens,
            max_num_seqs=o.max_num_seqs, per_request_sampling=o.per_request_sampling,
            device="cuda" if cuda else "cpu", use_triton=cuda)
        if self.engine is not None:
            self.engine.shutdown()
        self.loaded, self.config = loaded, config
        self.engine = AsyncEngine(LLMEngine(loaded, config))
        self.settings = SamplingSettings(loaded.defaults, per_request=o.per_request_sampling)
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
        if name and lookup(name) is None and not Path(name).expanduser().is_file():
            raise ModelNotFoundError(name)
        async with self._switch:
            if not reload and self.is_loaded(name):
                return
            await self._idle.wait()
            await asyncio.get_running_loop().run_in_executor(None, self.load, name)

    def begin(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def end(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()
