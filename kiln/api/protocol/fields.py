"""Reading a request's JSON: the body itself, then each field with its expected type.

A reader returns None when the field is absent or null and raises a 400 naming the field
(`param`, the path the client wrote: `options.temperature`, `input[2].content`) when it has
another JSON type: a bool is not a number, an integer is fine for a number, an integral number
such as 2.0 is fine for an integer. Every dialect's parser reads its fields through these, so a
mistyped field gets the same answer on every route.

`as_*` read a value already taken out of its object; `number(obj, key, param)` and its kin read
`obj[key]`, naming `param` (default: the key).
"""

from __future__ import annotations

import json

from kiln.runtime.errors import InvalidRequestError


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


def missing(param: str) -> InvalidRequestError:
    return InvalidRequestError(f"Missing required parameter: '{param}'.", param=param,
                               code="missing_required_parameter")


def bad(message: str, param: str, code: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


def unsupported(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="unsupported_value")


# --- values ---

def as_number(v: object, param: str) -> float | None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise invalid_type(param, "a number", v)
    return v


def as_integer(v: object, param: str) -> int | None:
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise invalid_type(param, "an integer", v)
    return v


def as_typed(v: object, kind: type, expected: str, param: str):
    if v is not None and not isinstance(v, kind):
        raise invalid_type(param, expected, v)
    return v


def as_strings(v: object, param: str) -> tuple[str, ...] | None:
    """A string or an array of strings, as a tuple."""
    if v is None or isinstance(v, str):
        return None if v is None else (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(v)
    raise invalid_type(param, "a string or an array of strings", v)


def as_token_ids(v: list, param: str) -> tuple[int, ...]:
    """An array of token ids (non-negative integers); whether each is in the vocabulary is
    the loaded model's to say (`check_vocabulary`)."""
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise bad(f"Invalid '{param}': token ids must be non-negative integers.", param,
                      "invalid_value")
    return tuple(v)


def check_vocabulary(ids, vocab_size: int, param: str) -> None:
    if ids and max(ids) >= vocab_size:
        raise bad(f"Token id {max(ids)} is outside the vocabulary (size {vocab_size}).", param,
                  "invalid_value")


# --- fields of an object ---

def number(obj: dict, key: str, param: str | None = None) -> float | None:
    return as_number(obj.get(key), param or key)


def integer(obj: dict, key: str, param: str | None = None) -> int | None:
    return as_integer(obj.get(key), param or key)


def typed(obj: dict, key: str, kind: type, expected: str, param: str | None = None):
    return as_typed(obj.get(key), kind, expected, param or key)


def boolean(obj: dict, key: str, param: str | None = None) -> bool | None:
    return typed(obj, key, bool, "a boolean", param)


def string(obj: dict, key: str, param: str | None = None) -> str | None:
    return typed(obj, key, str, "a string", param)


def json_object(obj: dict, key: str, param: str | None = None) -> dict | None:
    return typed(obj, key, dict, "an object", param)


def array(obj: dict, key: str, param: str | None = None) -> list | None:
    return typed(obj, key, list, "an array", param)


def required(value, param: str):
    """A field's value that must be there."""
    if value is None:
        raise missing(param)
    return value


# --- the body ---

def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def load_json_body(raw: bytes | str) -> dict:
    """Decode a request body; anything but a JSON object is a 400."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise InvalidRequestError("We could not parse the JSON body of your request.") from None
    check_unicode(body)
    return require_object(body)


def check_unicode(body: object) -> None:
    """A `\\ud800` escape parses to a lone surrogate, which no tokenizer (and no UTF-8
    response) can take: a 400 here, not an error deep in the request."""
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequestError("The request body contains a lone UTF-16 surrogate "
                                          "(an unpaired \\ud800-\\udfff escape), which is "
                                          "not valid Unicode text.") from None
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def require_object(body: object) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    return body
