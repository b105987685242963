"""The Sanic app: routes, the one exception handler, start-up and shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from sanic import Sanic
from sanic.exceptions import PayloadTooLarge, SanicException
from sanic.response import json

from kiln.api import access
from kiln.api.errors import error_response, ollama_error_body, ollama_route
from kiln.api.pipeline.admission import new_id
from kiln.api.protocol.completions import MAX_PROMPTS
from kiln.api.routes import (
    chat_completions,
    completions,
    models,
    ollama_chat,
    ollama_models,
    ollama_pull,
    ops,
    responses,
    tokenize,
    webui,
)
from kiln.api.state import ServeOptions, ServerState
from kiln.runtime.errors import KilnError

# (handler, path, method). A model id may hold ':' and '/' (smollm2:135m): the rest of the
# path is the id.
ROUTES = (
    (chat_completions.chat_completions, "/v1/chat/completions", "POST"),
    (completions.completions, "/v1/completions", "POST"),
    (responses.create_response, "/v1/responses", "POST"),
    (models.list_models, "/v1/models", "GET"),
    (models.retrieve_model, "/v1/models/<model_id:path>", "GET"),
    (tokenize.tokenize, "/tokenize", "POST"),
    (tokenize.detokenize, "/detokenize", "POST"),
    (tokenize.tokenizer_info, "/tokenizer_info", "GET"),
    (ops.metrics, "/metrics", "GET"),
    (ops.health, "/health", "GET"),
    (ops.load, "/api/load", "POST"),
    (ollama_chat.chat, "/api/chat", "POST"),
    (ollama_chat.generate, "/api/generate", "POST"),
    (ollama_models.tags, "/api/tags", "GET"),
    (ollama_models.show, "/api/show", "POST"),
    (ollama_models.ps, "/api/ps", "GET"),
    (ollama_models.version, "/api/version", "GET"),
    (ollama_pull.pull, "/api/pull", "POST"),
)

log = logging.getLogger("kiln")


def default_max_request_bytes(ctx_len: int) -> int:
    """Room for the most prompts a request may carry, each a whole context at 8 bytes of JSON
    a token, and 4 MiB for the rest (a logit_bias over the vocabulary, tools, schemas)."""
    return MAX_PROMPTS * ctx_len * 8 + (4 << 20)


def create_app(state: ServerState, name: str = "kiln") -> Sanic:
    app = Sanic(name, configure_logging=False)
    app.config.MOTD = False
    # Checked against Content-Length before the body is read: a body no context could hold
    # is refused at once (413), not parsed and tokenized first.
    app.config.REQUEST_MAX_SIZE = state.options.max_request_bytes \
        or default_max_request_bytes(state.serving.config.ctx_len)
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
        if state.serving is not None:
            state.serving.engine.shutdown()

    open_paths = webui.install(app) if state.options.webui else frozenset()
    access.install(app, state.options.access, open_paths)

    @app.on_response
    async def count_response(request, response):
        route = request.route.uri if request.route else "unmatched"
        state.metrics.http_response(route, request.method, response.status)

    app.ctx.ollama_pulls = {}  # tag -> the ollama_pull.Pull under way
    for handler, path, method in ROUTES:
        app.add_route(handler, path, methods=[method],
                      name=f"{handler.__module__.rsplit('.', 1)[-1]}_{handler.__name__}")

    @app.exception(Exception)
    async def on_error(request, exc):
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        if isinstance(exc, PayloadTooLarge):
            limit = app.config.REQUEST_MAX_SIZE
            body = {"error": {"message": f"The request body is larger than this server takes "
                              f"({limit} bytes, --max-request-bytes).",
                              "type": "invalid_request_error", "param": None,
                              "code": "request_too_large"}}
            status = 413
        elif isinstance(exc, SanicException) and not isinstance(exc, KilnError):
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
    if options.webui:
        log.info("[kiln]  Chat page on http://%s:%d/", host, port)
    app.run(host=host, port=port, single_process=True, access_log=False,
            motd=False)
    log.info("[kiln]  Stopped")
    return 0
