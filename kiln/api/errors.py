"""The one place where exceptions become HTTP error responses in OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`, with the status the contract names; on
Ollama's routes (`ollama_route`), in Ollama's shape `{"error": "message"}`, same status.

The runtime raises its typed errors (runtime/errors.py) without knowing HTTP; this module maps
each class to a status and OpenAI's error `type`, and defines the few errors only the HTTP
layer raises (a key, a shutdown, a download). The server calls `error_response` from its
exception handler, a stream's writer `error_body`; nothing else builds error bodies.
"""

from __future__ import annotations

import logging

from kiln.runtime.errors import (
    ContextLengthError,
    InvalidRequestError,
    KilnError,
    ModelNotFoundError,
    RequestFailedError,
)

logger = logging.getLogger("kiln")


class ServiceUnavailableError(KilnError):
    """The server is shutting down (SIGTERM) and takes no new requests (503)."""

    def __init__(self) -> None:
        super().__init__("The server is shutting down and accepts no new requests.",
                         param=None, code="service_unavailable")


class AuthenticationError(KilnError):
    """The server wants an API key (--api-key) and the request has none or another (401)."""

    def __init__(self, missing: bool) -> None:
        super().__init__("You didn't provide an API key: send it as 'Authorization: Bearer "
                         "<key>'." if missing else "Incorrect API key provided.", param=None,
                         code="invalid_api_key")


class UpstreamError(KilnError):
    """What kiln fetches from elsewhere could not be had (a model's download failed): 502."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param=None, code="upstream_error")


# Most specific first: (class, HTTP status, OpenAI error type)
_HTTP = (
    (ServiceUnavailableError, 503, "server_error"),
    (AuthenticationError, 401, "invalid_request_error"),
    (UpstreamError, 502, "server_error"),
    (ContextLengthError, 400, "model_error"),  # the reference runtime's body, word for word
    (ModelNotFoundError, 404, "invalid_request_error"),
    (InvalidRequestError, 400, "invalid_request_error"),
    (RequestFailedError, 500, "server_error"),
    (KilnError, 500, "server_error"),
)


def _mapping(exc: KilnError) -> tuple[int, str]:
    return next((status, kind) for cls, status, kind in _HTTP if isinstance(exc, cls))


def http_status(exc: KilnError) -> int:
    return _mapping(exc)[0]


def error_body(exc: KilnError) -> dict:
    return {"error": {"message": exc.message, "type": _mapping(exc)[1], "param": exc.param,
                      "code": exc.code}}


def error_response(exc: BaseException, request_id: str) -> tuple[int, dict]:
    """(HTTP status, JSON body) for any exception raised while serving `request_id`.

    Typed errors map to their own status and body. Anything else is a bug: its traceback
    goes to the log and the client gets a 500 that quotes the request id.
    """
    if not isinstance(exc, KilnError):
        logger.error("[kiln]  Internal error in request %s", request_id, exc_info=exc)
        exc = RequestFailedError(request_id)
    return http_status(exc), error_body(exc)


def ollama_route(path: str) -> bool:
    """Ollama's API lives under /api/ (kiln's own /api/load answers as the /v1 routes do)."""
    return path.startswith("/api/") and path != "/api/load"


def ollama_error_body(body: dict) -> dict:
    """An OpenAI-shaped error body in Ollama's shape: the message alone."""
    return {"error": body["error"]["message"]}
