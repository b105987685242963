"""The one way a model becomes a running engine, for `kiln serve` and `kiln run` alike:
resolve and load the model on this machine's backend, size the engine from the model and
the user's options, build the engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.llm_engine import LLMEngine
from kiln.runtime.models.loader import LoadedModel, load_model


@dataclass(frozen=True)
class EngineOptions:
    """What a user may set on the command line; None takes the model's own value."""

    ctx_len: int | None = None
    prefill_chunk_len: int | None = None
    kv_cache_tokens: int | None = None
    max_num_seqs: int = 64
    dtype: str = "float32"  # or bfloat16: oneDNN's bf16 products (backends/cpu/bf16.py)


def build_engine(model: str, options: EngineOptions) -> tuple[LoadedModel, LLMEngine]:
    """Load `model` (a catalogue tag or a GGUF path) and build its engine. Raises PullError
    or ModelLoadError with a message fit for the user."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    loaded = load_model(model, device=device, use_triton=cuda, dtype=getattr(torch, options.dtype))
    config = EngineConfig.build(
        loaded.ctx_len, loaded.max_prefill_len, ctx_len=options.ctx_len,
        prefill_chunk_len=options.prefill_chunk_len, kv_cache_tokens=options.kv_cache_tokens,
        max_num_seqs=options.max_num_seqs, device=device, use_triton=cuda)
    return loaded, LLMEngine(loaded, config)
