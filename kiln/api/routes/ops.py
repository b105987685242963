"""What operators and their tools call: GET /health, GET /metrics (Prometheus text) and
POST /api/load (load or reload a model, restoring its default sampling settings)."""

from __future__ import annotations

from sanic.response import raw

from kiln.api.metrics import CONTENT_TYPE_LATEST
from kiln.api.pipeline.reply import json_response
from kiln.api.pipeline.workers import read_body
from kiln.api.routes.models import defaults_json
from kiln.api.state import ServerState
from kiln.runtime.errors import InvalidRequestError


async def health(request):
    state: ServerState = request.app.ctx.state
    serving = state.serving
    stats = serving.engine.stats() if serving is not None else None
    body = {"status": "draining" if state.draining else "ok",
            "model": serving.model.name if serving is not None else None,
            "in_flight": state.in_flight,
            "kv_free_blocks": stats.kv_free_blocks if stats else 0,
            "kv_total_blocks": stats.kv_total_blocks if stats else 0}
    if serving is not None:
        body |= serving.engine.health()  # --replicas: the replicas and the routing
    return json_response(body)


async def metrics(request):
    state: ServerState = request.app.ctx.state
    return raw(state.metrics.exposition(), content_type=CONTENT_TYPE_LATEST)


async def load(request):
    state: ServerState = request.app.ctx.state
    body = await read_body(request)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("'model' must be a model name.", param="model")
    await state.ensure_model(model, reload=True)
    loaded = state.serving.model
    return json_response({"status": "loaded", "model": loaded.name,
                          "defaults": defaults_json(loaded.defaults)})
