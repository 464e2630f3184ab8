"""Untrusted JSON → Python values, with every way it can go wrong a 400 (never a 500 from deep inside a parser).

Both front ends read client JSON through here: the HTTP bodies, and the gRPC `chat_template_kwargs_json` field. Refused:
bad UTF-8 or JSON, NaN and Infinity, nesting deeper than `MAX_JSON_DEPTH`, integers longer than Python converts
(4,300 digits), and strings holding a lone UTF-16 surrogate (`"\\ud800"` is valid JSON but no Unicode text: it could
not be tokenized, rendered or written back out).
"""

from __future__ import annotations

import json
from typing import Any

from jengine.errors import InvalidRequestError

MAX_JSON_DEPTH = 32


def parse_json_body(raw: bytes, what: str = "the request body") -> dict[str, Any]:
    """A JSON object from bytes; anything else (bad UTF-8 or JSON, NaN, too deep, not an object) is a 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError(f"{what} is not valid UTF-8", param=None) from None
    return parse_json_object(text, what)


def parse_json_object(text: str, what: str, param: str | None = None) -> dict[str, Any]:
    """A JSON object from text, checked as the module says; `what` and `param` name it in errors."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except InvalidRequestError:
        raise
    except RecursionError:
        raise InvalidRequestError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels", param=param) from None
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{what} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
                                  param=param) from None
    except ValueError as exc:  # an integer over Python's int-string limit; the message says which limit
        raise InvalidRequestError(f"{what} holds a number Python cannot read: {str(exc)[:120]}", param=param) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{what} must be a JSON object, got {json_type(value)}", param=param)
    check_json_value(value, what, param)
    return value


def _reject_constant(name: str) -> Any:
    raise InvalidRequestError(f"{name} is not a JSON number")


def check_json_value(value: Any, what: str = "the JSON body", param: str | None = None,
                     limit: int = MAX_JSON_DEPTH) -> None:
    """Iterative (no recursion to exhaust): the deepest container at most `limit` levels down, every string (keys
    included) encodable as UTF-8."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise InvalidRequestError(f"{what} is nested deeper than {limit} levels", param=param)
        children = list(item.values()) + list(item) if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
            elif isinstance(child, str) and not child.isascii():
                _check_text(child, what, param)


def _check_text(text: str, what: str, param: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"{what} holds a string with a lone UTF-16 surrogate (not valid Unicode text)",
                                  param=param) from None


def json_type(value: Any) -> str:
    """JSON's name for a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)
