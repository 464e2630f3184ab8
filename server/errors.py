"""The one table that maps jengine's errors to HTTP statuses, OpenAI error JSON and gRPC status codes.

Both front ends (the OpenAI shim and the gRPC service) answer errors through this module, so a request refused on one
is refused the same way on the other. Messages that reach clients are bounded and sanitised: no file paths, no object
reprs, no control characters, and a bug (anything outside the `jengine.errors` hierarchy) says only its type.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from typing import TYPE_CHECKING, Any

from jengine.errors import (
    AuthenticationError, CapacityError, ContextLengthExceededError, DeadlineExceededError, InvalidRequestError,
    JengineError, NotFoundError, RequestTooLargeError, ServiceUnavailableError,
)

if TYPE_CHECKING:
    import grpc

MAX_MESSAGE_CHARS = 500
RETRY_AFTER_SECONDS = 1  # what a 429 tells clients to wait: slots free as fast as requests finish
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][\w.\-~@+]+){2,}[/\\]?")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclasses.dataclass(frozen=True)
class ErrorKind:
    """How one class of error is reported: HTTP status, OpenAI `type` and default `code`, gRPC status name."""

    http_status: int
    type: str
    code: str
    grpc_code: str  # a member name of grpc.StatusCode (grpc is imported only when a gRPC status is asked for)


class HeadersTooLargeError(RequestTooLargeError):
    """The request line and header fields together are over the HTTP server's limit (431; HTTP only)."""


# Most specific first: the first class an exception is an instance of decides (REFERENCE.md, "Errors and limits").
ERROR_TABLE: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (ContextLengthExceededError,
     ErrorKind(400, "invalid_request_error", "context_length_exceeded", "INVALID_ARGUMENT")),
    (HeadersTooLargeError, ErrorKind(431, "invalid_request_error", "request_too_large", "RESOURCE_EXHAUSTED")),
    (RequestTooLargeError, ErrorKind(413, "invalid_request_error", "request_too_large", "RESOURCE_EXHAUSTED")),
    (InvalidRequestError, ErrorKind(400, "invalid_request_error", "invalid_value", "INVALID_ARGUMENT")),
    (AuthenticationError, ErrorKind(401, "authentication_error", "invalid_api_key", "UNAUTHENTICATED")),
    (NotFoundError, ErrorKind(404, "invalid_request_error", "model_not_found", "NOT_FOUND")),
    (CapacityError, ErrorKind(429, "rate_limit_error", "server_overloaded", "RESOURCE_EXHAUSTED")),
    (ServiceUnavailableError, ErrorKind(503, "service_unavailable_error", "service_unavailable", "UNAVAILABLE")),
    (DeadlineExceededError, ErrorKind(504, "timeout", "timeout", "DEADLINE_EXCEEDED")),
    (asyncio.CancelledError, ErrorKind(499, "cancelled", "cancelled", "CANCELLED")),  # client gone: nobody reads it
)
INTERNAL = ErrorKind(500, "internal_error", "internal_error", "INTERNAL")


def error_kind(exc: BaseException) -> ErrorKind:
    """The table row for `exc`; anything unknown is a bug (500 / INTERNAL)."""
    for cls, kind in ERROR_TABLE:
        if isinstance(exc, cls):
            return kind
    return INTERNAL


def sanitize_message(message: str) -> str:
    """Bounded, single-line-safe text with file paths replaced, so no server detail leaks through an error."""
    message = _CONTROL.sub(" ", _PATH.sub("<path>", message)).strip()
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return message or "error"


def client_message(exc: BaseException) -> str:
    """What the client may read: our own errors' messages (sanitised); for a bug, its type and nothing else."""
    if isinstance(exc, JengineError):
        return sanitize_message(str(exc))
    if isinstance(exc, asyncio.CancelledError):
        return "the request was cancelled"
    return f"internal server error ({type(exc).__name__}); see the server log"


def http_status(exc: BaseException) -> int:
    return error_kind(exc).http_status


def error_code(exc: BaseException) -> str:
    """The exception's own code where it carries one (e.g. `no_chat_template`), else the table's."""
    code = getattr(exc, "code", None) if isinstance(exc, JengineError) else None
    return code if isinstance(code, str) and code else error_kind(exc).code


def openai_error(exc: BaseException) -> dict[str, Any]:
    """The inner OpenAI error object: {"message", "type", "param", "code"} (`code` a string, as OpenAI sends it)."""
    param = getattr(exc, "param", None) if isinstance(exc, JengineError) else None
    return {
        "message": client_message(exc),
        "type": error_kind(exc).type,
        "param": sanitize_message(param)[:100] if isinstance(param, str) else None,
        "code": error_code(exc),
    }


def openai_error_body(exc: BaseException) -> dict[str, Any]:
    """The whole OpenAI error JSON body."""
    return {"error": openai_error(exc)}


def http_headers(exc: BaseException) -> dict[str, str]:
    """Extra headers an error response carries: Retry-After on 429 and 503, WWW-Authenticate on 401."""
    status = http_status(exc)
    if status in (429, 503):
        return {"Retry-After": str(RETRY_AFTER_SECONDS)}
    if status == 401:
        return {"WWW-Authenticate": 'Bearer realm="jengine"'}
    return {}


def grpc_status(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for `exc` (grpc imported here only, so HTTP-only users do not load it)."""
    import grpc

    return getattr(grpc.StatusCode, error_kind(exc).grpc_code)


def grpc_details(exc: BaseException) -> str:
    """The status details string a gRPC error carries: the same sanitised message clients of HTTP read."""
    return client_message(exc)
