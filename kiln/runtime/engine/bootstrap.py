"""The one way a model becomes a running engine, for `kiln serve` and `kiln run` alike:
resolve and load the model on this machine's backend, size the engine from the model and
the user's options, build the engine (and start it, for serving)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kiln.runtime.backends import resolve_dtype
from kiln.runtime.drafting.config import SpeculativeConfig
from kiln.runtime.engine.async_engine import AsyncEngine
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.llm_engine import LLMEngine
from kiln.runtime.kv.memory import kv_bytes_per_token, kv_cache_tokens_for_memory
from kiln.runtime.models.loader import LoadedModel, load_model
from kiln.runtime.store.gguf_file import ModelLoadError


@dataclass(frozen=True)
class EngineOptions:
    """What a user may set on the command line; None takes the model's (or device's) own."""

    ctx_len: int | None = None
    prefill_chunk_len: int | None = None
    kv_cache_tokens: int | None = None  # None: from GPU memory on CUDA, 4 contexts on the CPU
    max_num_seqs: int | None = None  # None: 256 on CUDA, 64 on the CPU
    # tokens a step computes; None: 8192 on CUDA (several prompts' chunks in one step: a
    # prefill step is launch-bound there), a chunk and a token per request on the CPU
    max_num_batched_tokens: int | None = None
    dtype: str = "auto"  # runtime.backends.resolve_dtype
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # CUDA: no CUDA graphs (vLLM's flag)
    async_scheduling: bool = False  # EngineConfig.async_scheduling (vLLM's flag)
    # CUDA: products whose reduction order never follows the batch (kernels/matmul.py), so a
    # seeded or greedy request's bits do not depend on its neighbours; False: cuBLAS's
    batch_invariant: bool = True
    threads: int | None = None  # CPU kernels' threads; None: one per core (a cluster
    # replica takes the CPUs Ray gave it, so replicas sharing a machine do not oversubscribe)
    speculative: SpeculativeConfig | None = None  # --speculative: drafting; None: off
    # CPU: the products on 8-bit activations (runtime/backends/cpu/csrc/linear_i8.c); None:
    # with dtype "auto" (fp32 products with an explicit float32). With "auto" the CPU's KV
    # cache is fp16 too.
    int8_activations: bool | None = None


GPU_BATCHED_TOKENS = 8192  # vLLM's default for its server on large GPUs


def build_engine(model: str, options: EngineOptions) -> tuple[LoadedModel, LLMEngine]:
    """Load `model` (a catalogue tag or a GGUF path) and build its engine. Raises PullError
    or ModelLoadError (also for a GPU whose memory cannot hold a context) with a message fit
    for the user."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, resolve_dtype(options.dtype, cuda))
    int8 = options.int8_activations
    if int8 is None:
        int8 = not cuda and options.dtype == "auto"
    kv_fp16 = not cuda and options.dtype == "auto"  # llama.cpp's default KV cache type too
    loaded = load_model(model, device=device, use_triton=cuda, dtype=dtype,
                        threads=options.threads, int8_activations=int8, kv_fp16=kv_fp16,
                        batch_invariant=cuda and options.batch_invariant)
    kv_itemsize = 2 if kv_fp16 else dtype.itemsize
    config = EngineConfig.build(
        loaded.ctx_len, loaded.max_prefill_len, ctx_len=options.ctx_len,
        prefill_chunk_len=options.prefill_chunk_len, kv_cache_tokens=options.kv_cache_tokens,
        max_num_seqs=options.max_num_seqs or (256 if cuda else 64),
        max_num_batched_tokens=options.max_num_batched_tokens or (GPU_BATCHED_TOKENS if cuda
                                                                  else 0), device=device,
        use_triton=cuda, cuda_graphs=cuda and not options.enforce_eager,
        async_scheduling=options.async_scheduling,
        speculative=options.speculative, numerics=loaded.model.backend.numerics,
        kv_bytes_per_token=kv_bytes_per_token(loaded.config, kv_itemsize))
    if cuda and options.kv_cache_tokens is None:
        free, total = torch.cuda.mem_get_info()
        try:
            tokens = kv_cache_tokens_for_memory(free, total, options.gpu_memory_utilization,
                                                loaded.config, config, dtype.itemsize)
        except ValueError as exc:
            raise ModelLoadError(loaded.path, str(exc)) from exc
        # Every running request holds at least a block.
        config = replace(config, kv_cache_tokens=tokens,
                         max_num_seqs=min(config.max_num_seqs, tokens // config.block_size))
    return loaded, LLMEngine(loaded, config)


def start_engine(model: str, options: EngineOptions) -> tuple[LoadedModel, AsyncEngine]:
    """build_engine, the engine on its own thread: what `kiln serve` and a cluster's replica
    serve requests from."""
    loaded, engine = build_engine(model, options)
    return loaded, AsyncEngine(engine)
