"""Errors a client is meant to see, as typed values: what went wrong (`message`), which
field (`param`) and a machine-readable `code`. The runtime knows nothing of HTTP: api/errors.py
maps each class to its status and OpenAI's error `type`, in one place."""

from __future__ import annotations


class KilnError(Exception):
    """Base of every error a client is meant to see."""

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, param={self.param!r})"


class InvalidRequestError(KilnError):
    """The request is malformed; `param` names the offending field."""



class ContextLengthError(KilnError):
    """The prompt (plus max_tokens, when sent) does not fit in the context.

    The message is the reference runtime's, word for word, and so is its code (400).
    """

    MESSAGE = "Max length reached!"

    def __init__(self, *, num_prompt_tokens: int | None = None,
                 max_tokens: int | None = None, ctx_len: int | None = None) -> None:
        super().__init__(self.MESSAGE, param=None, code=400)
        # Kept for the server log; not part of the body.
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.ctx_len = ctx_len


class KVCacheCapacityError(InvalidRequestError):
    """A request that the whole KV cache could not hold, alone: refused before any prefill
    (it would otherwise wait, or be preempted, for ever)."""

    def __init__(self, *, num_prompt_tokens: int, max_tokens: int | None,
                 kv_cache_tokens: int) -> None:
        need = f"{num_prompt_tokens} prompt tokens" + (
            f" plus max_tokens {max_tokens}" if max_tokens is not None else " and a reply")
        super().__init__(f"This request needs room for {need} in the KV cache, which holds "
                         f"{kv_cache_tokens} tokens on this server (--kv-cache-tokens).",
                         param="max_tokens" if max_tokens is not None else None,
                         code="context_length_exceeded")


class ModelNotFoundError(KilnError):
    """A model name that is no catalogue tag, served model or file in the operator's model
    directories. The message never echoes the name and is the same for every such name, so
    it tells nothing of the server's files."""

    MESSAGE = "The model does not exist or is not available on this server."

    def __init__(self) -> None:
        super().__init__(self.MESSAGE, param="model", code="model_not_found")


class RequestFailedError(KilnError):
    """The server failed a request (a bug, an engine that aborted it, a replica lost): the
    message quotes the request id for the server's log."""

    def __init__(self, request_id: str, detail: str = "") -> None:
        message = f"The server had an error while processing request {request_id}."
        if detail:
            message += f" {detail}"
        super().__init__(message, param=None, code=None)
        self.request_id = request_id

