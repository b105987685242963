"""The Sanic app: routes, the one exception handler, start-up and shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from sanic import Sanic
from sanic.exceptions import SanicException
from sanic.response import json, raw

from kiln.api import access, ollama
from kiln.api.errors import error_response, ollama_error_body, ollama_route
from kiln.api.handlers import chat_completions, completions
from kiln.api.json_fields import load_json_body
from kiln.api.metrics import CONTENT_TYPE_LATEST
from kiln.api.models import defaults_json, list_models, retrieve_model
from kiln.api.openai_responses import create_response
from kiln.api.responses import new_id
from kiln.api.state import ServeOptions, ServerState
from kiln.api.tokenize import detokenize, tokenize
from kiln.runtime.errors import InvalidRequestError, KilnError

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

    access.install(app, state.options.access)

    @app.on_response
    async def count_response(request, response):
        route = request.route.uri if request.route else "unmatched"
        state.metrics.http_response(route, request.method, response.status)

    app.add_route(chat_completions, "/v1/chat/completions", methods=["POST"])
    app.add_route(completions, "/v1/completions", methods=["POST"])
    app.add_route(create_response, "/v1/responses", methods=["POST"])
    app.add_route(list_models, "/v1/models", methods=["GET"])
    # A model id may hold ':' and '/' (smollm2:135m): the rest of the path is the id.
    app.add_route(retrieve_model, "/v1/models/<model_id:path>", methods=["GET"])
    app.add_route(tokenize, "/tokenize", methods=["POST"])
    app.add_route(detokenize, "/detokenize", methods=["POST"])

    @app.get("/metrics")
    async def metrics(request):
        return raw(state.metrics.exposition(), content_type=CONTENT_TYPE_LATEST)

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
            raise InvalidRequestError("'model' must be a model name.", param="model")
        await state.ensure_model(model, reload=True)
        return json({"status": "loaded", "model": state.loaded.name,
                     "defaults": defaults_json(state.loaded.defaults)})

    ollama.add_routes(app)

    @app.exception(Exception)
    async def on_error(request, exc):
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        if isinstance(exc, SanicException) and not isinstance(exc, KilnError):
            status = getattr(exc, "status_code", 500)
            body = {"error": {"message": str(exc), "type": "invalid_request_error"
                              if status < 500 else "server_error",
                              "param": None, "code": status}}
        else:
            status, body = error_response(exc, new_id("req"))
        if ollama_route(request.path):
            body = ollama_error_body(body)
        return json(body, status=status)

    return app


def serve(model: str, options: ServeOptions, host: str, port: int) -> int:
    from kiln.cluster.options import ClusterError
    from kiln.runtime.store.gguf_file import ModelLoadError
    from kiln.runtime.store.pull import PullError

    state = ServerState(options)
    try:
        state.start(model)
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
