"""Ollama's API for the models kiln serves, so Ollama's clients (the official `ollama`
Python client first) work against `kiln serve`: /api/chat and /api/generate on kiln's chat
pipeline (generate.py, with request.py translating Ollama's bodies), the model routes
(models.py) and /api/pull (pull.py). Errors on these routes are Ollama's `{"error": "..."}`
(api/errors.py, keyed on the path)."""

from __future__ import annotations

from sanic import Sanic

from kiln.api.ollama import generate, models, pull


def add_routes(app: Sanic) -> None:
    app.ctx.ollama_pulls = {}  # tag -> the pull.Pull under way
    for handler, path, method in (
        (generate.chat, "/api/chat", "POST"),
        (generate.generate, "/api/generate", "POST"),
        (models.tags, "/api/tags", "GET"),
        (models.show, "/api/show", "POST"),
        (models.ps, "/api/ps", "GET"),
        (models.version, "/api/version", "GET"),
        (pull.pull, "/api/pull", "POST"),
    ):
        app.add_route(handler, path, methods=[method], name=f"ollama_{handler.__name__}")
