"""Load a model by catalogue tag or GGUF path: config, weights, tokenizer, chat template."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime import quant_linear
from runtime.catalogue import CatalogueEntry, SamplingDefaults
from runtime.chat_template import ChatTemplate
from runtime.config import ModelConfig
from runtime.gguf_loader import ModelLoadError, load_tensors, open_gguf
from runtime.models import gemma3, llama
from runtime.pull import resolve_model
from runtime.tokenizer import Tokenizer

log = logging.getLogger("kiln")

ARCHITECTURES = {"llama": llama, "gemma3": gemma3}
# A GGUF outside the catalogue samples with these until requests say otherwise.
GENERIC_DEFAULTS = SamplingDefaults(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05,
                                    presence_penalty=0.0, frequency_penalty=0.0,
                                    repetition_penalty=1.0)


@dataclass
class LoadedModel:
    name: str  # the tag or path the user gave
    path: Path
    entry: CatalogueEntry | None
    config: ModelConfig
    model: object  # an architecture's model class
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    load_seconds: float

    @property
    def defaults(self) -> SamplingDefaults:
        return self.entry.defaults if self.entry else GENERIC_DEFAULTS

    @property
    def max_prefill_len(self) -> int:
        return self.entry.max_prefill_len if self.entry else 1024

    @property
    def ctx_len(self) -> int:
        return min(self.entry.ctx_len, self.config.max_position) if self.entry \
            else self.config.max_position

    @property
    def reasoning_tags(self) -> tuple[str, str] | None:
        return self.entry.reasoning_tags if self.entry else ("<think>", "</think>")


def load_model(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
               use_triton: bool = False, cpu_weights: str = "gguf") -> LoadedModel:
    """cpu_weights: "gguf" lets the CPU's fp32 products read the GGUF's quantized blocks
    where kiln has a kernel for them (runtime/quant_linear.py); "fp32" keeps to the
    dequantized weights."""
    t0 = time.perf_counter()
    path, entry = resolve_model(name)
    gf = open_gguf(path)
    arch = ARCHITECTURES[gf.arch]
    config = arch.read_config(gf)
    tensors = load_tensors(gf)
    kw = {}
    if cpu_weights == "gguf" and getattr(arch, "READS_GGUF_BLOCKS", False) \
            and device == "cpu" and not use_triton and dtype == torch.float32 \
            and quant_linear.library() is not None:
        kw["gguf_blocks"] = {t.name: t for t in gf.reader.tensors}
    try:
        model = arch.Model(config, tensors, device, dtype, use_triton=use_triton, **kw)
    except KeyError as exc:
        raise ModelLoadError(path, f"missing tensor {exc}") from exc
    tokenizer = Tokenizer.from_gguf(gf.reader)
    template = ChatTemplate.from_gguf(gf.reader, fallback=entry.chat_template if entry else None)
    seconds = time.perf_counter() - t0
    log.info("[kiln]  Loaded %s (%s, %d layers) in %.1f s", name, gf.arch, config.num_layers,
             seconds)
    return LoadedModel(name, Path(path), entry, config, model, tokenizer, template, seconds)
