"""Errors as typed values. Any layer may raise them; api/errors.py maps them to HTTP in one place.

Each error knows its HTTP status and OpenAI's error fields (`type`, `param`, `code`), so the
body a client sees is always `{"error": {"message", "type", "param", "code"}}`. runtime/
raises these without importing api/: data flows api -> runtime, never back.
"""

from __future__ import annotations


class KilnError(Exception):
    """Base of every error a client is meant to see."""

    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, param={self.param!r})"


class InvalidRequestError(KilnError):
    """HTTP 400: the request is malformed; `param` names the offending field."""

    status = 400
    type = "invalid_request_error"


class ContextLengthError(KilnError):
    """HTTP 400: the prompt (plus max_tokens, when sent) does not fit in the context.

    The body is the reference runtime's, word for word: "Max length reached!", type
    "model_error", code 400.
    """

    status = 400
    type = "model_error"
    MESSAGE = "Max length reached!"

    def __init__(self, *, num_prompt_tokens: int | None = None,
                 max_tokens: int | None = None, ctx_len: int | None = None) -> None:
        super().__init__(self.MESSAGE, param=None, code=400)
        # Kept for the server log; not part of the body.
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.ctx_len = ctx_len


class ModelNotFoundError(KilnError):
    """HTTP 404: no such model tag or GGUF path."""

    status = 404
    type = "invalid_request_error"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model",
                         code="model_not_found")
        self.model = model


class InternalServerError(KilnError):
    """HTTP 500: a bug or a failure on our side; the message carries the request id to quote."""

    status = 500
    type = "server_error"

    def __init__(self, request_id: str, detail: str = "") -> None:
        message = f"The server had an error while processing request {request_id}."
        if detail:
            message += f" {detail}"
        super().__init__(message, param=None, code=None)
        self.request_id = request_id


def json_type_name(value: object) -> str:
    """How OpenAI names a JSON value's type in its error messages ("a string", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def invalid_type(param: str, expected: str, value: object) -> InvalidRequestError:
    """A 400 for a known field of the wrong JSON type, worded like OpenAI's."""
    return InvalidRequestError(
        f"Invalid type for '{param}': expected {expected}, but got {json_type_name(value)} "
        "instead.", param=param, code="invalid_type")
