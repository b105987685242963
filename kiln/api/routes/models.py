"""`GET /v1/models` and `GET /v1/models/{id}`: a card for each model a client may name (the
catalogue, the files of the operator's model directories, the model the server was started
with), with its sampling defaults and context length."""

from __future__ import annotations

import time
from urllib.parse import unquote

from kiln.api.pipeline.reply import json_response
from kiln.api.state import ServerState
from kiln.runtime.errors import ModelNotFoundError
from kiln.runtime.models.loader import GENERIC_DEFAULTS
from kiln.runtime.store.catalogue import CATALOGUE


def defaults_json(d) -> dict:
    return {"temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k,
            "min_p": d.min_p, "presence_penalty": d.presence_penalty,
            "frequency_penalty": d.frequency_penalty,
            "repetition_penalty": d.repetition_penalty, "repeat_last_n": d.repeat_last_n}


def model_card(name: str, defaults, ctx_len: int | None, loaded: bool) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "kiln",
            "context_length": ctx_len, "loaded": loaded, "defaults": defaults_json(defaults)}


def model_cards(state: ServerState) -> list[dict]:
    """The loaded model shows the context this server gives it (--ctx-len applied); a file
    not loaded yet shows none (it is known once the file is read)."""
    serving = state.serving
    current = serving.model.name if serving is not None else None
    ctx = serving.config.ctx_len if serving is not None else None
    cards = [model_card(tag, entry.defaults, ctx if tag == current else entry.ctx_len,
                        tag == current)
             for tag, entry in CATALOGUE.items()]
    names = [m.name for m in state.model_dirs.listing()]
    if state.startup is not None:
        names.append(state.startup.name)
    if current is not None:
        names.append(current)
    for name in dict.fromkeys(names):
        if name in CATALOGUE:
            continue
        if name == current:
            cards.append(model_card(name, serving.model.defaults, ctx, True))
        else:
            cards.append(model_card(name, GENERIC_DEFAULTS, None, False))
    return cards


async def list_models(request):
    return json_response({"object": "list", "data": model_cards(request.app.ctx.state)})


async def retrieve_model(request, model_id: str):
    name = unquote(model_id)  # Sanic hands path parameters over still percent-encoded
    card = next((c for c in model_cards(request.app.ctx.state) if c["id"] == name), None)
    if card is None:
        raise ModelNotFoundError()
    return json_response(card)
