"""The one place where exceptions become HTTP error responses in OpenAI's shape.

The error classes live in runtime/errors.py so the engine can raise them without importing
api/. The server calls `error_response` from its exception handler and sends the body as
JSON with the returned status; nothing else builds error bodies.
"""

from __future__ import annotations

import logging

from kiln.runtime.errors import (
    ContextLengthError,
    InternalServerError,
    InvalidRequestError,
    KilnError,
    ModelNotFoundError,
)

__all__ = [
    "ContextLengthError",
    "InternalServerError",
    "InvalidRequestError",
    "KilnError",
    "ModelNotFoundError",
    "error_response",
]

logger = logging.getLogger("kiln")


def error_response(exc: BaseException, request_id: str) -> tuple[int, dict]:
    """(HTTP status, JSON body) for any exception raised while serving `request_id`.

    Typed errors map to their own status and body. Anything else is a bug: its traceback
    goes to the log and the client gets a 500 that quotes the request id.
    """
    if isinstance(exc, KilnError):
        return exc.status, exc.to_body()
    logger.error("[kiln]  Internal error in request %s", request_id, exc_info=exc)
    err = InternalServerError(request_id)
    return err.status, err.to_body()
