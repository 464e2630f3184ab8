"""HTTP-level limits of the OpenAI server: the size of a request's header block, and errors found while parsing.

aiohttp's parser refuses an oversized header line, too many header fields or a malformed request before any
middleware runs, and answers with a bare text 400. `JsonErrorRunner` serves connections whose refusals are OpenAI error
JSON instead (431 for headers over the limit); the app's middleware refuses, with `header_block_bytes`, a block whose
fields are each small but together too large, which the parser does not measure.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from jengine.errors import DeadlineExceededError, InvalidRequestError
from server.errors import HeadersTooLargeError, http_headers, http_status, openai_error_body
from server.openai.routes import json_response

logger = logging.getLogger(__name__)

MAX_HEADER_FIELDS = 128  # aiohttp's default count, stated here so the 431 message can name it
KEEPALIVE_SECONDS = 5.0
"""An idle connection closes after this long (uvicorn's default, which vLLM serves with; aiohttp's is an hour). The
same timer runs from the connection's start and from the end of each response until a request's head is complete,
so it is the header-read timeout too: a client trickling header bytes is closed after it."""


def parser_limits(max_header_bytes: int) -> dict[str, int]:
    """aiohttp's per-line limits, at the whole block's limit: one line over it is a block over it."""
    return {"max_line_size": max_header_bytes, "max_field_size": max_header_bytes, "max_headers": MAX_HEADER_FIELDS}


def headers_too_large(limit: int) -> HeadersTooLargeError:
    return HeadersTooLargeError(f"the request headers are over the limit of {limit} bytes "
                                f"(request line and fields together, at most {MAX_HEADER_FIELDS} fields)")


def header_block_bytes(request: web.BaseRequest) -> int:
    """The size of the request line and header fields as sent (separators included)."""
    line = len(request.method) + len(request.raw_path) + len("  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in request.raw_headers)


def error_response(exc: BaseException) -> web.Response:
    """Any error as OpenAI error JSON with the table's status and headers (Retry-After on 429/503)."""
    return json_response(openai_error_body(exc), status=http_status(exc), headers=http_headers(exc))


class _JsonErrorHandler(web.RequestHandler):
    """A connection whose protocol-level refusals are OpenAI error JSON (aiohttp still logs them and closes)."""

    def __init__(self, *args: Any, max_header_bytes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._max_header_bytes = max_header_bytes

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logging, and the refusal once a response has begun
        response = error_response(self._as_jengine_error(status, exc))
        response.force_close()
        return response

    def _as_jengine_error(self, status: int, exc: BaseException | None) -> BaseException:
        if isinstance(exc, LineTooLong) or (isinstance(exc, BadHttpMessage) and "Too many headers" in exc.message):
            return headers_too_large(self._max_header_bytes)
        if status == 400:
            return InvalidRequestError("malformed HTTP request", code="invalid_value")
        if status == 504:
            return DeadlineExceededError("the request handler timed out")
        return exc if exc is not None else RuntimeError("HTTP protocol error")


class _JsonErrorServer(web.Server):
    def __init__(self, *args: Any, max_header_bytes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._max_header_bytes = max_header_bytes

    def __call__(self) -> web.RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, max_header_bytes=self._max_header_bytes, **self._kwargs)


class JsonErrorRunner(web.AppRunner):
    """`web.AppRunner` whose server answers protocol-level errors as OpenAI error JSON, with explicit header limits."""

    def __init__(self, app: web.Application, *, max_header_bytes: int, **kwargs: Any) -> None:
        super().__init__(app, **kwargs, **parser_limits(max_header_bytes))
        self._max_header_bytes = max_header_bytes

    async def _make_server(self) -> web.Server:
        """aiohttp's own server (application start-up included), re-made with the JSON-answering connections."""
        plain = await super()._make_server()
        return _JsonErrorServer(plain.request_handler, request_factory=plain.request_factory,
                                handler_cancellation=plain.handler_cancellation, loop=plain._loop,
                                max_header_bytes=self._max_header_bytes, **plain._kwargs)
