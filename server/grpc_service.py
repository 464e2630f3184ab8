"""The `jengine.v1.Engine` gRPC service over any `EngineClient`, with grpc.health.v1 and server reflection.

Generate streams `client.generate` deltas; when the call ends early (the client cancels, its deadline passes, the
connection drops) gRPC cancels the handler task, and closing the engine's stream aborts the request in the engine, which
frees its KV blocks. Errors map to status codes through `server/errors.py` only, so a request refused over HTTP is
refused the same way here; the exception's type, code and param ride in the trailers so `GrpcEngineClient` can raise
the same jengine error on the other side. One interceptor gates every method except health and reflection: the API
key (compared in constant time), then the drain (UNAVAILABLE once `set_serving(False)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jengine.clients.protocol import EngineClient, LoraClient
from jengine.tokenizer.chat import chat_text
from jengine.errors import (
    AuthenticationError, DeadlineExceededError, InvalidRequestError, JengineError, NotFoundError,
    ServiceUnavailableError,
)
from jengine.lora.request import LoRARequest
from jengine.outputs import RequestOutput
from jengine.v1 import jengine_pb2 as pb
from jengine.v1 import jengine_pb2_grpc as pb_grpc
from server.errors import error_code, grpc_details, grpc_status
from server.grpc_convert import (
    OutputEncoder, chat_options_from_proto, messages_from_proto, model_info_to_proto, prompt_from_request,
    sampling_from_proto, stats_to_proto,
)
from server.grpc_tools import chat_parsing
from server.grpc_structured import structured_from_proto
from server.request_work import RequestWork, prepare_prompts

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Engine"].full_name  # "jengine.v1.Engine"
WATCH_POLL_S = 0.5  # how soon an open Health.Watch stream hears that the engine died
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
OPEN_SERVICES = (HEALTH_SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection")
"""Reachable without a key and while draining: probes and tooling must see the server's state."""
ERROR_TYPE_KEY, ERROR_CODE_KEY, ERROR_PARAM_KEY = "jengine-error-type", "jengine-error-code", "jengine-error-param"


class _Gate:
    """What the interceptor and the health service share: the key and whether new calls are taken."""

    def __init__(self, api_key: str | None) -> None:
        self.expected = api_key.encode() if api_key is not None else None
        self.serving = True

    def refusal(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> JengineError | None:
        """The error a call must end with, or None to let it through. The scheme is case-insensitive (RFC 7235), as
        on the HTTP side."""
        scheme, _, token = _authorization(metadata).partition(b" ")
        if self.expected is not None and not (scheme.lower() == b"bearer"
                                              and hmac.compare_digest(token.strip(), self.expected)):
            return AuthenticationError("missing or wrong API key: send metadata 'authorization: Bearer <key>'")
        if not self.serving:
            return ServiceUnavailableError("the server is draining and takes no new requests")
        return None


def _authorization(metadata: Sequence[tuple[str, str | bytes]] | None) -> bytes:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, bytes) else value.encode()
    return b""


class _GateInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the engine service before any request bytes are parsed; health and reflection pass."""

    def __init__(self, gate: _Gate) -> None:
        self._gate = gate

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        service = details.method.lstrip("/").rpartition("/")[0]
        error = None if service in OPEN_SERVICES else self._gate.refusal(details.invocation_metadata)
        handler = await continuation(details)
        if error is not None:
            return _refusing_handler(handler, error)
        return _decoding_checked(handler) if service == SERVICE_NAME and handler is not None else handler


_UNDECODABLE = object()


def _decoding_checked(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The same handler, except that a request message that does not decode ends the call with INVALID_ARGUMENT
    (gRPC's own answer, UNKNOWN, would tell the client nothing)."""
    decode = handler.request_deserializer

    def lenient(raw: bytes) -> Any:
        try:
            return decode(raw)
        except DecodeError:
            return _UNDECODABLE

    async def check(request: Any, context: grpc.aio.ServicerContext) -> None:
        if request is _UNDECODABLE:
            await abort_with(context, InvalidRequestError("the request message is not a valid protobuf message"))

    if handler.response_streaming:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await check(request, context)
            async for item in handler.unary_stream(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(stream, lenient, handler.response_serializer)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await check(request, context)
        return await handler.unary_unary(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, lenient, handler.response_serializer)


def _refusing_handler(handler: grpc.RpcMethodHandler | None, error: JengineError) -> grpc.RpcMethodHandler:
    """A handler of the same shape (unary or streaming response) that only ends the call with `error`'s status."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await abort_with(context, error)

    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with `exc`'s row of the error table; bugs are logged here, their details never sent."""
    if not isinstance(exc, JengineError):
        logger.exception("gRPC call failed", exc_info=exc)
    trailers = [(ERROR_TYPE_KEY, type(exc).__name__), (ERROR_CODE_KEY, error_code(exc))]
    param = getattr(exc, "param", None)
    if isinstance(param, str):
        trailers.append((ERROR_PARAM_KEY, param[:100]))
    await context.abort(grpc_status(exc), grpc_details(exc), trailing_metadata=tuple(trailers))


class EngineService(pb_grpc.EngineServicer):
    """The four methods of jengine.v1.Engine; every engine interaction goes through the EngineClient protocol."""

    def __init__(self, client: EngineClient, work: RequestWork, lora: LoraClient | None = None) -> None:
        """`lora`: the client whose adapters `lora_name` names (None: a request naming one is refused)."""
        self._client = client
        self._work = work  # tokenizing and chat rendering run there, off the event loop
        self._lora = lora

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        deadline = _deadline(context)
        try:
            adapter = self._adapter(request.lora_name)
            params = sampling_from_proto(request.sampling)
            structured = structured_from_proto(request)
            if structured is not None:
                params = params.clone(structured_outputs=structured)
            prompt = prompt_from_request(request)
            info = self._client.get_model_info()
            parsing, params = chat_parsing(request, info.chat_parsing, params)
            [prompt] = await self._work.run(prepare_prompts, self._client.get_tokenizer(), info, [prompt], params)
            encoder = OutputEncoder(params, parsing)
            stream = self._client.generate(prompt, params, request.request_id or uuid.uuid4().hex,
                                           priority=request.priority, **adapter)
            async with contextlib.aclosing(stream):  # closing it early aborts the request in the engine
                async for output in _until(stream, deadline):
                    yield encoder.encode(output)
        except Exception as exc:  # a cancelled call raises CancelledError (not an Exception): nobody to tell
            await abort_with(context, exc)

    def _adapter(self, name: str) -> dict[str, LoRARequest]:
        """`lora_request=` for the generate call when `lora_name` names a loaded adapter ({} for none)."""
        if not name:
            return {}
        known = [r for r in self._lora.list_loras() if r.lora_name == name] if self._lora is not None else []
        if not known:
            raise NotFoundError(f"no LoRA adapter named {name[:100]!r} is loaded", code="lora_not_found")
        return {"lora_request": known[0]}

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        return await _unary(context, lambda: self._work.run(self._tokenize, request))

    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
                         ) -> pb.DetokenizeResponse:
        return await _unary(context, lambda: self._work.run(self._detokenize, request))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> pb.GetModelInfoResponse:
        return await _unary(context, lambda: model_info_to_proto(self._client.get_model_info(),
                                                                 self._client.get_tokenizer()))

    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        return await _unary(context, lambda: stats_to_proto(self._client.stats()))

    def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        """vLLM's /tokenize: text with special tokens by default; chats rendered, without (the template holds BOS)."""
        tokenizer, kind = self._client.get_tokenizer(), request.WhichOneof("input")
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else kind == "text"
        response = pb.TokenizeResponse(max_model_len=self._client.get_model_info().max_model_len)
        if kind == "text":
            ids = tokenizer.encode(request.text, add_special_tokens=add_special)
        elif kind == "messages":
            chat = request.messages
            response.prompt = chat_text(tokenizer, messages_from_proto(chat), chat_options_from_proto(chat))
            ids = tokenizer.encode(response.prompt, add_special_tokens=add_special)
        else:
            raise InvalidRequestError("set text or messages", param="input")
        response.token_ids.extend(ids)
        response.count = len(ids)
        return response

    def _detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        vocab_size = self._client.get_model_info().vocab_size
        for position, token in enumerate(request.token_ids):
            if not 0 <= token < vocab_size:
                raise InvalidRequestError(f"token id {token} at position {position} is not in [0, {vocab_size})",
                                          param="token_ids")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        spaces = request.spaces_between_special_tokens if request.HasField("spaces_between_special_tokens") else True
        tokenizer, ids = self._client.get_tokenizer(), list(request.token_ids)
        response = pb.DetokenizeResponse(text=tokenizer.decode(ids, skip, spaces_between_special_tokens=spaces))
        if request.return_token_strs:
            response.token_strs.extend(tokenizer.convert_ids_to_tokens(ids))
        return response


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline on the event loop's clock, or None."""
    remaining = context.time_remaining()
    return None if remaining is None else asyncio.get_running_loop().time() + remaining


async def _until(stream: AsyncIterator[RequestOutput], deadline: float | None) -> AsyncIterator[RequestOutput]:
    """The stream's outputs until the deadline, which aborts the request at once (the wait for the next output is
    cancelled inside the engine's stream) rather than whenever gRPC notices the expired call."""
    loop = asyncio.get_running_loop()
    while True:
        timeout = None if deadline is None else max(0.0, deadline - loop.time())
        try:
            output = await asyncio.wait_for(anext(stream), timeout)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise DeadlineExceededError("the call's deadline passed; the request was aborted") from None
        yield output


async def _unary(context: grpc.aio.ServicerContext, fn: Callable[[], Any]) -> Any:
    """Run a host-only call (tokenizer, model info; a coroutine for work handed to the work pool); its errors end the
    call through the table."""
    try:
        result = fn()
        return await result if asyncio.iscoroutine(result) else result
    except Exception as exc:
        await abort_with(context, exc)


class _Health(health.aio.HealthServicer):
    """grpc.health.v1 whose answer is live: NOT_SERVING while draining or once the engine is dead."""

    def __init__(self, gate: _Gate, client: EngineClient) -> None:
        super().__init__()
        self._gate, self._client = gate, client
        self._published: int | None = None

    def status(self) -> int:
        serving = self._gate.serving and self._client.is_healthy()
        return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
                    ) -> health_pb2.HealthCheckResponse:
        await self.publish()
        return await super().Check(request, context)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        await self.publish()
        following = asyncio.ensure_future(self._follow_engine())
        try:
            await super().Watch(request, context)
        finally:
            following.cancel()

    async def _follow_engine(self) -> None:
        """While a Watch stream is open, re-read the engine's health: an engine that dies tells no one, so without
        this a stream opened before the failure would say SERVING forever (Check reads it live)."""
        while True:
            await asyncio.sleep(WATCH_POLL_S)
            await self.publish()

    async def publish(self) -> None:
        """Store the live status for the overall server ("") and the engine service (wakes Watch streams)."""
        status = self.status()
        if status != self._published:
            self._published = status
            for service in ("", SERVICE_NAME):
                await self.set(service, status)


class JengineGrpcServer(grpc.aio.Server):
    """The running `grpc.aio.Server`, plus `set_serving`: the drain hook the app calls before stopping."""

    def __init__(self, server: grpc.aio.Server, health: _Health, gate: _Gate, port: int) -> None:
        self._server, self._health, self._gate = server, health, gate
        self.port = port  # the bound port (useful when 0 asked for a free one)
        self._loop = asyncio.get_running_loop()
        self._publishing: asyncio.Task[None] | None = None  # held: the loop keeps only weak references to tasks

    def set_serving(self, serving: bool) -> None:
        """False: new engine calls get UNAVAILABLE and health says NOT_SERVING, while running streams finish.

        Callable from any thread; the gate flips at once, Health.Watch streams hear of it on the server's loop."""
        self._gate.serving = serving
        self._loop.call_soon_threadsafe(self._publish)

    def _publish(self) -> None:
        self._publishing = self._loop.create_task(self._health.publish())

    # grpc.aio.Server's interface, delegated.
    def add_generic_rpc_handlers(self, generic_rpc_handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._server.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self._server.add_secure_port(address, server_credentials)

    async def start(self) -> None:
        await self._server.start()

    async def stop(self, grace: float | None) -> None:
        self._gate.serving = False
        await self._health.publish()
        await self._server.stop(grace)

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self._server.wait_for_termination(timeout)


async def start_grpc_server(client: EngineClient, host: str, port: int, api_key: str | None = None, *,
                            work: RequestWork | None = None, lora: LoraClient | None = None) -> JengineGrpcServer:
    """Serve jengine.v1.Engine, health and reflection on host:port (0 = a free port, see `.port`); started.
    `work`: the pool for tokenizing (the HTTP app's, when both serve; else one of its own). `lora`: the client
    serving the adapters `lora_name` names (default: `client`, when it serves them)."""
    gate = _Gate(api_key)
    server = grpc.aio.server(interceptors=[_GateInterceptor(gate)])
    lora = lora if lora is not None else client if isinstance(client, LoraClient) else None
    pb_grpc.add_EngineServicer_to_server(EngineService(client, work or RequestWork(), lora), server)
    health_servicer = _Health(gate, client)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(_address(host, port))
    await server.start()
    await health_servicer.publish()
    logger.info("gRPC service %s listening on %s", SERVICE_NAME, _address(host, bound))
    return JengineGrpcServer(server, health_servicer, gate, bound)


def _address(host: str, port: int) -> str:
    """host:port, with IPv6 literals bracketed."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
