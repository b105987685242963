"""The Sanic app: routes, the one exception handler, start-up and shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

from sanic import Sanic
from sanic.exceptions import SanicException
from sanic.response import json

from kiln.api.errors import error_response
from kiln.api.handlers import chat_completions, completions
from kiln.api.protocol import load_json_body
from kiln.api.responses import new_id
from kiln.api.state import ServeOptions, ServerState
from kiln.runtime.errors import InvalidRequestError, KilnError
from kiln.runtime.store.catalogue import CATALOGUE

log = logging.getLogger("kiln")


def create_app(state: ServerState, name: str = "kiln") -> Sanic:
    app = Sanic(name, configure_logging=False)
    app.config.MOTD = False
    app.config.REQUEST_MAX_SIZE = 64 * 1024 * 1024
    app.config.RESPONSE_TIMEOUT = 3600
    app.config.KEEP_ALIVE_TIMEOUT = 75
    # By the time Sanic stops, ServerState.drain has ended every reply: its own grace only
    # closes idle connections.
    app.config.GRACEFUL_SHUTDOWN_TIMEOUT = 5.0
    app.ctx.state = state

    async def shut_down():
        await state.drain()
        app.stop(terminate=False)

    @app.after_server_start
    async def take_signals(app):
        """SIGTERM or SIGINT drains first (the socket stays open: new requests get a 503),
        then stops; a second one stops at once. Sanic's own handlers would stop first."""
        loop = asyncio.get_running_loop()

        def on_signal():
            if state.draining:
                app.stop(terminate=False)
            else:
                loop.create_task(shut_down())
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)

    @app.after_server_stop
    async def stop_engine(app):
        if state.engine is not None:
            state.engine.shutdown()

    app.add_route(chat_completions, "/v1/chat/completions", methods=["POST"])
    app.add_route(completions, "/v1/completions", methods=["POST"])

    @app.get("/v1/models")
    async def models(request):
        loaded = state.loaded
        data = []
        for tag, entry in CATALOGUE.items():
            is_loaded = loaded is not None and loaded.name == tag
            # The loaded model shows the context this server gives it (--ctx-len applied).
            data.append(_model_card(tag, entry.defaults,
                                    state.config.ctx_len if is_loaded else entry.ctx_len,
                                    is_loaded))
        if loaded is not None and loaded.name not in CATALOGUE:
            data.append(_model_card(loaded.name, loaded.defaults, state.config.ctx_len, True))
        return json({"object": "list", "data": data})

    @app.get("/health")
    async def health(request):
        loaded = state.loaded
        free, total = state.engine.kv_blocks() if state.engine else (0, 0)
        body = {"status": "draining" if state.draining else "ok",
                "model": loaded.name if loaded else None, "in_flight": state.in_flight,
                "kv_free_blocks": free, "kv_total_blocks": total}
        if hasattr(state.engine, "cluster_health"):  # --replicas: replicas and routing
            body["cluster"] = state.engine.cluster_health()
        return json(body)

    @app.post("/api/load")
    async def load(request):
        body = load_json_body(request.body)
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            raise InvalidRequestError("'model' must be a model tag or a .gguf path.",
                                      param="model")
        await state.ensure_model(model, reload=True)
        return json({"status": "loaded", "model": state.loaded.name,
                     "defaults": _defaults(state.loaded.defaults)})

    @app.exception(Exception)
    async def on_error(request, exc):
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        if isinstance(exc, SanicException) and not isinstance(exc, KilnError):
            status = getattr(exc, "status_code", 500)
            return json({"error": {"message": str(exc), "type": "invalid_request_error"
                                   if status < 500 else "server_error",
                                   "param": None, "code": status}}, status=status)
        status, body = error_response(exc, new_id("req"))
        return json(body, status=status)

    return app


def _defaults(d) -> dict:
    return {"temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k,
            "min_p": d.min_p, "presence_penalty": d.presence_penalty,
            "frequency_penalty": d.frequency_penalty,
            "repetition_penalty": d.repetition_penalty, "repeat_last_n": d.repeat_last_n}


def _model_card(name: str, defaults, ctx_len: int, loaded: bool) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "kiln",
            "context_length": ctx_len, "loaded": loaded, "defaults": _defaults(defaults)}


def serve(model: str, options: ServeOptions, host: str, port: int) -> int:
    from kiln.cluster.options import ClusterError
    from kiln.runtime.store.gguf_file import ModelLoadError
    from kiln.runtime.store.pull import PullError

    state = ServerState(options)
    try:
        state.load(model)
    except (PullError, ModelLoadError, ClusterError) as exc:
        print(f"kiln serve: {exc}", file=sys.stderr)
        return 1
    app = create_app(state)
    url = f"http://{host}:{port}/v1"
    log.info("[kiln]  Listening on %s", url)
    app.run(host=host, port=port, single_process=True, access_log=False,
            motd=False)
    log.info("[kiln]  Stopped")
    return 0
