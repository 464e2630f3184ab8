"""The serving process: the OpenAI HTTP app and the gRPC service over one `EngineClient`, and their lifecycle.

`/health` (and its alias `/ping`), `/metrics`, `/version` and `/openapi.json` are open; every other route needs the API key when one
is set (Bearer, compared in constant time). SIGTERM (or SIGINT) drains: /health turns 503 at once, new requests get
503, in-flight requests finish up to `drain_timeout`, then connections close (aborting whatever is left), the engine
stops and the process exits 0. Every error leaves as OpenAI error JSON through the one table in `server/errors.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hmac
import importlib.metadata
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from jengine.config import ServerConfig
from jengine.clients.protocol import EngineClient, LoraClient
from server.metrics import EngineMetrics, MeteredEngineClient
from server.stats_log import StatsLogger
from jengine.errors import (
    AuthenticationError, EngineDeadError, InvalidRequestError, JengineError, NotFoundError, RequestTooLargeError,
    ServiceUnavailableError,
)
from server import cors
from server.errors import openai_error_body
from server.http_limits import KEEPALIVE_SECONDS, JsonErrorRunner, error_response, header_block_bytes, headers_too_large
from server.openai.openapi import openapi_document
from server.openai.routes import OpenAIRoutes, json_response
from server.request_work import RequestWork

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/openapi.json"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def version() -> str:
    try:
        return importlib.metadata.version("jengine")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0+unknown"


@dataclasses.dataclass(eq=False)
class ServerState:
    """What the handlers share: the metered client, the config, the registry, and the drain bookkeeping."""

    client: EngineClient  # metered: what both front ends serve from
    engine: EngineClient  # the client as given (tests read AsyncEngine's state through it)
    config: ServerConfig
    metrics: EngineMetrics
    work: RequestWork  # the bounded pool for parsing, tokenizing and encoding, off the event loop
    draining: bool = False
    in_flight: int = 0  # API requests being handled now (what a drain waits for)

    @classmethod
    def create(cls, engine: EngineClient, config: ServerConfig) -> ServerState:
        prefixes = ("jengine", "vllm") if config.metrics_prefix == "both" else (config.metrics_prefix,)
        metrics = EngineMetrics(engine, engine.get_model_info().name, prefixes=prefixes,
                                log_requests=config.log_requests)
        return cls(MeteredEngineClient(engine, metrics), engine, config, metrics, RequestWork())


def _lora_client(state: ServerState) -> LoraClient | None:
    """The engine as the server of LoRA adapters, when it is one (the in-process engine)."""
    return state.engine if isinstance(state.engine, LoraClient) else None


STATE = web.AppKey("jengine_state", ServerState)
ROUTES = web.AppKey("jengine_openai_routes", OpenAIRoutes)


# ---------------------------------------------------------------------------------------------------------- app
def build_app(state: ServerState) -> web.Application:
    """The aiohttp application: middlewares (CORS preflight → errors → header size → auth → drain/in-flight), OpenAI
    routes, health and metrics."""
    config = state.config
    cors_policy = cors.policy_from(config.allowed_origins, config.allowed_methods, config.allowed_headers,
                                   config.allow_credentials)
    app = web.Application(middlewares=[cors.preflight_middleware(cors_policy), _errors_middleware,
                                       _header_limit_middleware, _auth_middleware, _drain_middleware],
                          client_max_size=config.max_body_bytes)
    cors.install(app, cors_policy)
    app[STATE] = state
    app[ROUTES] = OpenAIRoutes(state.client, state.work, fingerprint=f"fp_jengine_{version()}",
                               max_n=state.config.max_n, max_body_bytes=state.config.max_body_bytes,
                               request_timeout=state.config.request_timeout,
                               lora=_lora_client(state))
    app[ROUTES].register(app)
    app.router.add_get("/health", _health)
    app.router.add_route("*", "/ping", _health)  # vLLM's (SageMaker's) liveness route, GET or POST
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    return app


@web.middleware
async def _errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except JengineError as exc:
        response = error_response(exc)
        if not request.content.is_eof():  # refused before the body was read whole (or it did not decode): the
            response.force_close()  # connection's next bytes are no request, so it closes
        return response
    except web.HTTPException as exc:  # aiohttp's own: no route, wrong method, body over client_max_size
        if exc.status < 400:
            raise
        return _aiohttp_error(exc)
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client is gone: nobody reads an answer
    except Exception as exc:  # a bug: log it whole, tell the client only its type
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(exc)


def _aiohttp_error(exc: web.HTTPException) -> web.StreamResponse:
    """aiohttp's own refusals in OpenAI's shape, keeping their status."""
    if exc.status == 404:
        return error_response(NotFoundError("no such route", code="not_found"))
    if exc.status == 413:
        return error_response(RequestTooLargeError("the request body is over the size limit"))
    error = InvalidRequestError(exc.reason or "bad request",
                                code="method_not_allowed" if exc.status == 405 else "invalid_value")
    allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    return json_response(openai_error_body(error), status=exc.status, headers=allow)


@web.middleware
async def _header_limit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Fields each under the parser's line limit may still add up to a block over the limit: 431 as well."""
    limit = request.app[STATE].config.max_header_bytes
    if header_block_bytes(request) > limit:
        raise headers_too_large(limit)
    return await handler(request)


@web.middleware
async def _auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[STATE].config.api_key
    if key is not None and request.path not in OPEN_PATHS and not _authorized(request, key):
        raise AuthenticationError("missing or wrong API key: send the header 'Authorization: Bearer <key>'")
    return await handler(request)


def _authorized(request: web.Request, key: str) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    # aiohttp keeps undecodable header bytes as surrogates: they compare (unequal) instead of failing to encode
    sent = token.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent, key.encode())


@web.middleware
async def _drain_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Counts API requests in flight; once draining, new ones are refused with 503."""
    state = request.app[STATE]
    if request.path in OPEN_PATHS:
        return await handler(request)
    if state.draining:
        raise ServiceUnavailableError("the server is shutting down; retry on another replica")
    state.in_flight += 1
    try:
        return await handler(request)
    finally:
        state.in_flight -= 1


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        raise ServiceUnavailableError("the server is shutting down")
    if not state.client.is_healthy():
        raise EngineDeadError("the engine is not running")
    return web.Response(status=200)


async def _version(request: web.Request) -> web.Response:
    return json_response({"version": version()})


async def _openapi(request: web.Request) -> web.Response:
    return json_response(openapi_document(version()))


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[STATE].metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


# ---------------------------------------------------------------------------------------------------------- lifecycle
@dataclasses.dataclass(eq=False)
class RunningServer:
    """The HTTP site (and the gRPC server, when there is one) started on the current event loop."""

    state: ServerState
    runner: web.AppRunner
    grpc_server: Any = None
    stats_log: asyncio.Task | None = None  # the periodic stats line (none with log_stats_interval 0)

    @property
    def port(self) -> int:
        """The HTTP port actually bound (the configured one, or the one the OS chose for port 0)."""
        return self.runner.addresses[0][1]

    async def drain(self, timeout: float) -> None:
        """503 for /health and new requests at once; then wait for in-flight requests (HTTP and gRPC) up to timeout."""
        self.state.draining = True
        deadline = time.monotonic() + timeout
        grpc_stop = asyncio.ensure_future(self.grpc_server.stop(timeout)) if self.grpc_server is not None else None
        while self.state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.state.in_flight:
            logger.warning("drain timeout: closing %d unfinished request(s)", self.state.in_flight)
            await self.runner.app[ROUTES].cut_streams()
        if grpc_stop is not None:
            await grpc_stop

    async def close(self) -> None:
        """Close every connection (handlers still running are cancelled, which aborts their requests)."""
        if self.stats_log is not None:
            self.stats_log.cancel()
        if self.grpc_server is not None:
            await self.grpc_server.stop(0)
        await self.runner.cleanup()
        self.state.work.close()
        gc.unfreeze()


async def start_server(state: ServerState, *, with_grpc: bool = False) -> RunningServer:
    """Bind the HTTP app (and the gRPC service, if asked and available) on the current loop."""
    config = state.config
    freeze_startup_heap()  # before the port opens: the collection must not delay a first request
    runner = JsonErrorRunner(build_app(state), max_header_bytes=config.max_header_bytes, handler_cancellation=True,
                             access_log=None, shutdown_timeout=1.0, keepalive_timeout=KEEPALIVE_SECONDS)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    server = RunningServer(state, runner)
    if with_grpc and config.grpc_port:
        server.grpc_server = await _start_grpc(state)
    if config.log_stats_interval > 0:
        server.stats_log = asyncio.create_task(StatsLogger(state.metrics, config.log_stats_interval).run())
    info = state.client.get_model_info()
    logger.info("OpenAI API on http://%s:%d/v1 serving %r (max_model_len %d)", config.host, server.port, info.name,
                info.max_model_len)
    return server


def freeze_startup_heap() -> None:
    """Moves what start-up built (modules, the engine, the tokenizer, compiled programs' wrappers) out of the garbage
    collector's reach, once its garbage is collected. A full collection walks every tracked object while holding the
    GIL: in a process of a million objects it took 0.7 s, a stall of every stream and of `/health`; afterwards it
    walks only what serving allocates. `RunningServer.close` unfreezes them."""
    gc.collect()
    gc.freeze()


async def _start_grpc(state: ServerState) -> Any:
    """The gRPC service over the same client; skipped with a warning where it is not built (yet)."""
    try:
        from server.grpc_service import start_grpc_server
    except ImportError as exc:
        logger.warning("gRPC service not available (%s); serving HTTP only", exc)
        return None
    config = state.config
    grpc_server = await start_grpc_server(state.client, config.host, config.grpc_port, config.api_key,
                                          work=state.work, lora=_lora_client(state))
    logger.info("gRPC service on %s:%d", config.host, config.grpc_port)
    return grpc_server


async def serve_until_signal(state: ServerState, *, with_grpc: bool) -> None:
    """Serve until SIGTERM/SIGINT, then drain and close (the caller shuts the engine down)."""
    server = await start_server(state, with_grpc=with_grpc)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        logger.info("shutdown requested: draining for up to %.0f s", state.config.drain_timeout)
        await server.drain(state.config.drain_timeout)
    finally:
        await server.close()


def run_server(make_engine: Callable[[], EngineClient], config: ServerConfig, *, with_grpc: bool) -> int:
    """Blocking entry point of `jengine serve` / `jengine openai`; returns the exit status (0 after a drain).

    The client is made inside the event loop, because a gRPC-backed one binds its channel to the running loop."""

    async def main() -> None:
        engine = make_engine()
        try:
            await serve_until_signal(ServerState.create(engine, config), with_grpc=with_grpc)
        finally:
            engine.shutdown()

    asyncio.run(main())
    logger.info("server stopped")
    return 0
