"""Ollama's model routes: /api/tags (the models on this machine), /api/show (one model's
template, parameters and GGUF metadata), /api/ps (the loaded model), /api/version.

"On this machine" means the catalogue models already pulled into the kiln cache, and the
loaded model (which may be a GGUF path). Nothing else is described: a name that is neither
is a 404, whether or not some file by that name exists. GGUF metadata is read from the file's
header (runtime/store/gguf_meta.py), off the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from kiln.api.pipeline.reply import json_response
from kiln.api.pipeline.workers import read_body
from kiln.api.protocol.ollama import model_name
from kiln.api.routes.ollama_wire import OLLAMA_VERSION, timestamp
from kiln.api.state import ServerState
from kiln.runtime.errors import ModelNotFoundError
from kiln.runtime.models.loader import GENERIC_DEFAULTS
from kiln.runtime.store.catalogue import CATALOGUE, CatalogueEntry, SamplingDefaults
from kiln.runtime.store.gguf_meta import GGUFMetadata, LongArray, read_metadata
from kiln.runtime.store.pull import is_pulled, model_path

# kiln keeps its model loaded until it stops; Ollama reports keep_alive -1 this far ahead.
KEPT_LOADED = timedelta(days=365 * 100)


@dataclass(frozen=True)
class ListedModel:
    """A model as Ollama's routes list it."""

    name: str
    path: Path
    entry: CatalogueEntry | None  # None: a GGUF path the server was given

    @property
    def defaults(self) -> SamplingDefaults:
        return self.entry.defaults if self.entry else GENERIC_DEFAULTS

    def digest(self) -> str:
        """The catalogue's sha256 of the file; for a GGUF path, a hash of its path, size and
        mtime (an identity that changes with the file, not a hash of its gigabytes)."""
        if self.entry is not None:
            return self.entry.sha256
        st = self.path.stat()
        return hashlib.sha256(f"{self.path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
                              .encode()).hexdigest()


def local_models(state: ServerState) -> list[ListedModel]:
    models = [ListedModel(tag, model_path(e), e) for tag, e in CATALOGUE.items() if is_pulled(e)]
    models += [ListedModel(m.name, m.path, None) for m in state.model_dirs.listing()]
    serving = state.serving
    if serving is not None and all(m.name != serving.model.name for m in models):
        models.append(ListedModel(serving.model.name, serving.model.path, None))
    return models


def find_local(state: ServerState, name: str) -> ListedModel:
    for m in local_models(state):
        if m.name == name:
            return m
    ref = state.resolve(name)  # a name the server does not serve: ModelNotFoundError
    serving = state.serving
    if serving is not None and state.is_loaded(ref):  # the loaded model, by another name
        return ListedModel(name, serving.model.path, serving.model.entry)
    raise ModelNotFoundError()


def human_number(n: int) -> str:
    """Ollama's parameter_size: 134515008 -> "134.52M", 8030261248 -> "8.0B"."""
    for unit, size, decimals in (("B", 10**9, 1), ("M", 10**6, 2)):
        if n >= size:
            value = n / size
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.{decimals}f}{unit}"
    return f"{n / 1000:.0f}K" if n >= 1000 else str(n)


def details(meta: GGUFMetadata) -> dict:
    return {"parent_model": "", "format": "gguf", "family": meta.arch,
            "families": [meta.arch], "parameter_size": human_number(meta.parameter_count),
            "quantization_level": meta.quantization}


def _card(m: ListedModel) -> dict:
    meta, st = read_metadata(m.path), m.path.stat()
    return {"name": m.name, "model": m.name, "modified_at": timestamp(st.st_mtime),
            "size": st.st_size, "digest": m.digest(), "details": details(meta)}


async def _off_loop(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# --- routes --------------------------------------------------------------------------------

async def tags(request):
    state: ServerState = request.app.ctx.state
    models = await _off_loop(lambda: [_card(m) for m in local_models(state)])
    return json_response({"models": models})


async def ps(request):
    state: ServerState = request.app.ctx.state
    serving = state.serving
    if serving is None:
        return json_response({"models": []})
    model, config = serving.model, serving.config
    card = await _off_loop(_card, ListedModel(model.name, model.path, model.entry))
    # The weights as the file holds them, and the KV cache (every replica's, on a cluster).
    kv = serving.engine.stats().kv_total_blocks * config.block_size * config.kv_bytes_per_token
    size = card["size"] + kv
    card.pop("modified_at")
    card.update(size=size, size_vram=size if config.device.startswith("cuda") else 0,
                expires_at=timestamp(datetime.now(timezone.utc) + KEPT_LOADED),
                context_length=config.ctx_len)
    return json_response({"models": [card]})


async def show(request):
    state: ServerState = request.app.ctx.state
    body = await read_body(request)
    name = model_name(body)
    m = find_local(state, name)
    meta = await _off_loop(read_metadata, m.path)
    serving = state.serving
    loaded = serving.model if serving is not None and serving.model.path == m.path else None
    if loaded is not None:
        template = loaded.chat_template.template_str if loaded.chat_template else ""
        ctx_len = serving.config.ctx_len
    else:
        template = meta.get("tokenizer.chat_template") or \
            (m.entry.chat_template if m.entry else "") or ""
        ctx_len = m.entry.ctx_len if m.entry else meta.get(f"{meta.arch}.context_length", 0)
    params = parameters(m.defaults, ctx_len)
    capabilities = ["completion", "tools"] + (["thinking"] if "enable_thinking" in template
                                             else [])
    return json_response({
        "license": meta.get("general.license", ""),
        "modelfile": modelfile(m, template, params, meta.get("general.license", "")),
        "parameters": "\n".join(f"{k:<30} {v}" for k, v in params),
        "template": template,
        "details": details(meta),
        "model_info": model_info(meta),
        "capabilities": capabilities,
        "modified_at": timestamp(m.path.stat().st_mtime),
    })


async def version(request):
    return json_response({"version": OLLAMA_VERSION})


# --- /api/show's pieces ---------------------------------------------------------------------

def parameters(d: SamplingDefaults, ctx_len: int) -> list[tuple[str, str]]:
    """The model's default sampling settings as Ollama's parameter names and values."""
    return [("num_ctx", str(ctx_len)), ("temperature", f"{d.temperature:g}"),
            ("top_p", f"{d.top_p:g}"), ("top_k", str(d.top_k)), ("min_p", f"{d.min_p:g}"),
            ("presence_penalty", f"{d.presence_penalty:g}"),
            ("frequency_penalty", f"{d.frequency_penalty:g}"),
            ("repeat_penalty", f"{d.repetition_penalty:g}"),
            ("repeat_last_n", str(d.repeat_last_n))]


def modelfile(m: ListedModel, template: str, params: list[tuple[str, str]],
              license_: str) -> str:
    lines = ['# Modelfile generated by "ollama show"',
             "# To build a new Modelfile based on this, replace FROM with:",
             f"# FROM {m.name}", "", f"FROM {m.path}", f'TEMPLATE """{template}"""']
    lines += [f"PARAMETER {k} {v}" for k, v in params]
    if license_:
        lines.append(f'LICENSE """{license_}"""')
    return "\n".join(lines) + "\n"


def model_info(meta: GGUFMetadata) -> dict:
    """The GGUF's key-values as Ollama shows them: long arrays (the vocabulary) empty, the
    name and chat template left out (the template has its own field)."""
    info = {k: ([] if isinstance(v, LongArray) else v) for k, v in meta.fields.items()
            if k not in ("general.name", "tokenizer.chat_template")}
    info["general.parameter_count"] = meta.parameter_count
    return info
