"""Load a model by catalogue tag or GGUF path: config, weights, tokenizer, chat template."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from kiln.runtime.backends import make_backend
from kiln.runtime.models import gemma3, llama
from kiln.runtime.models.config import ModelConfig
from kiln.runtime.models.decoder import DecoderModel
from kiln.runtime.store.catalogue import CatalogueEntry, SamplingDefaults
from kiln.runtime.store.gguf_file import ModelLoadError, open_gguf
from kiln.runtime.store.pull import resolve_model
from kiln.runtime.text.chat_template import ChatTemplate
from kiln.runtime.text.tokenizer import Tokenizer

log = logging.getLogger("kiln")

ARCHITECTURES = {arch: llama for arch in llama.ARCHS} | {"gemma3": gemma3}
# A GGUF outside the catalogue samples with these until requests say otherwise.
GENERIC_DEFAULTS = SamplingDefaults(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05,
                                    presence_penalty=0.0, frequency_penalty=0.0,
                                    repetition_penalty=1.0)


@dataclass(frozen=True)
class ModelInfo:
    """A model as the API needs it, without its weights: what it is (name, file, catalogue
    entry, config), how its text is read and written (tokenizer, chat template), and the
    values derived from those. A cluster's ingress holds only this; the replicas load the
    weights."""

    name: str  # what clients call it: a catalogue tag, a models-directory file name, a path
    path: Path
    entry: CatalogueEntry | None
    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None  # None: the GGUF has no usable one (no chat, then)

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

    def chat_prompt_ids(self, messages: list[dict], **template_kwargs) -> list[int]:
        """The prompt of a chat: the template renders BOS itself where the model wants one,
        so the text is encoded without adding special tokens (as apply_chat_template does)."""
        text = self.chat_template.render(messages, add_generation_prompt=True, **template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)


@dataclass(frozen=True)
class LoadedModel(ModelInfo):
    """A model with its weights, on its backend."""

    model: DecoderModel
    load_seconds: float


def _read_info(name: str, path: Path, entry: CatalogueEntry | None, gf) -> ModelInfo:
    config = ARCHITECTURES[gf.arch].read_config(gf)
    tokenizer = Tokenizer.from_gguf(gf.reader)
    try:
        template = ChatTemplate.from_gguf(gf.reader,
                                          fallback=entry.chat_template if entry else None)
    except ValueError as exc:  # none in the file, or one that does not parse (TemplateError)
        # The model still completes text; chat requests are refused with a 400.
        log.warning("[kiln]  %s has no usable chat template: %s", name, exc)
        template = None
    return ModelInfo(name, Path(path), entry, config, tokenizer, template)


def describe_model(name: str) -> ModelInfo:
    """The model `name` means (pulled if it must be), read from its GGUF header, without its
    weights. Raises as load_model does (PullError, ModelLoadError)."""
    path, entry = resolve_model(name)
    return _read_info(name, path, entry, open_gguf(path))


def load_model(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
               use_triton: bool = False, backend=None, threads: int | None = None,
               int8_activations: bool = False, kv_fp16: bool = False,
               batch_invariant: bool = False) -> LoadedModel:
    """backend: where the model runs (runtime/backends); by default the CPU kernels on a
    CPU (bf16 products with dtype=torch.bfloat16, products on 8-bit activations with
    int8_activations, an fp16 KV cache with kv_fp16, on `threads` threads), torch on dense
    weights otherwise (Triton's batch-invariant products with batch_invariant)."""
    t0 = time.perf_counter()
    path, entry = resolve_model(name)
    gf = open_gguf(path)
    info = _read_info(name, path, entry, gf)
    backend = backend or make_backend(device, dtype, use_triton, threads, int8_activations,
                                     kv_fp16, batch_invariant)
    try:
        model = ARCHITECTURES[gf.arch].build(info.config, gf, backend)
    except ValueError as exc:  # a tensor type no backend kernel reads, a bad shape
        raise ModelLoadError(path, str(exc)) from exc
    seconds = time.perf_counter() - t0
    log.info("[kiln]  Loaded %s (%s, %d layers, %s backend) in %.1f s", name, gf.arch,
             info.config.num_layers, backend.name, seconds)
    return LoadedModel(**{f.name: getattr(info, f.name) for f in fields(ModelInfo)},
                       model=model, load_seconds=seconds)
