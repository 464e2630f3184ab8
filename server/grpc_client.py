"""`GrpcEngineClient`: the `EngineClient` protocol over a remote jengine's gRPC service (`jengine openai --engine`).

The OpenAI shim runs unchanged over it: `generate` yields the same `RequestOutput` deltas the in-process engine yields
(rebuilt by `server.grpc_convert`), errors arrive as the same `jengine.errors` classes (the server sends the type,
code and param in the trailers), and abort cancels the call, which aborts the request in the remote engine.

Streams use a `grpc.aio` channel, made on first use in the caller's event loop (an aio channel belongs to one loop).
The protocol's synchronous methods (model info, tokenizer, health, stats) use a blocking channel: quick loopback or
LAN round trips; the model info is fetched once and kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jengine import errors
from jengine.clients.protocol import ModelInfo, request_identity
from jengine.engine.stats import EngineStats
from jengine.front.input_processor import PromptInput
from jengine.errors import InvalidRequestError, JengineError, NotFoundError, RequestTooLargeError
from jengine.outputs import RequestOutput
from jengine.sampling.params import SamplingParams
from jengine.v1 import jengine_pb2 as pb
from jengine.v1 import jengine_pb2_grpc as pb_grpc
from server.errors import ERROR_TABLE
from server.grpc_convert import (
    OutputDecoder, fill_prompt, messages_to_proto, model_info_from_proto, sampling_to_proto, stats_from_proto,
)
from server.grpc_structured import structured_to_proto
from server.grpc_service import ERROR_CODE_KEY, ERROR_PARAM_KEY, ERROR_TYPE_KEY, SERVICE_NAME

logger = logging.getLogger(__name__)

UNARY_TIMEOUT_S = 30.0  # a tokenizer or info call that takes longer means the engine is gone
STATS_TIMEOUT_S = 2.0
HEALTH_TIMEOUT_S = 2.0
# Replies may be larger than gRPC's 4 MiB default (a long prompt's tokenization with token strings, its prompt
# logprobs); requests stay under the server's own limit, which it enforces.
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", 256 * 2**20),)


class GrpcEngineClient:
    """EngineClient over gRPC; safe to share by every request of one event loop."""

    def __init__(self, address: str, api_key: str | None = None) -> None:
        self._address = address
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._sync_channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._sync_stub = pb_grpc.EngineStub(self._sync_channel)
        self._aio: tuple[asyncio.AbstractEventLoop, grpc.aio.Channel, pb_grpc.EngineStub] | None = None
        self._calls: dict[str, grpc.aio.UnaryStreamCall] = {}
        self._aborted: set[str] = set()
        self._model_info: pb.GetModelInfoResponse | None = None
        self._tokenizer: RemoteTokenizer | None = None

    # ------------------------------------------------------------------ EngineClient
    async def generate(self, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream the remote request's deltas; leaving early (or `abort`) cancels the call, aborting it remotely."""
        params, request_id = request_identity(sampling_params, request_id, self._calls)
        request, prompt_text = _generate_request(prompt, params, request_id, priority)
        call = self._stub().Generate(request, metadata=self._metadata)
        self._calls[request_id] = call
        decoder = OutputDecoder(params, prompt_text)
        try:
            async for output in _stream_outputs(call, decoder):
                yield output
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            if request_id not in self._aborted:
                raise exception_from_rpc(exc) if isinstance(exc, grpc.aio.AioRpcError) else exc
            yield decoder.aborted(request_id, params.n if isinstance(params.n, int) else 1)
        finally:
            call.cancel()  # no-op once finished; otherwise the remote engine aborts the request
            self._calls.pop(request_id, None)
            self._aborted.discard(request_id)

    async def abort(self, request_id: str) -> None:
        """Cancel the call; the local stream ends with finish_reason "abort" as the in-process engine's does."""
        call = self._calls.get(request_id)
        if call is not None and not call.done():
            self._aborted.add(request_id)
            call.cancel()

    def get_tokenizer(self) -> RemoteTokenizer:
        if self._tokenizer is None:
            self._tokenizer = RemoteTokenizer(self, self._info().tokenizer)
        return self._tokenizer

    def get_model_info(self) -> ModelInfo:
        return model_info_from_proto(self._info())

    def is_healthy(self) -> bool:
        """The remote health service says SERVING for jengine.v1.Engine (False when unreachable)."""
        stub = health_pb2_grpc.HealthStub(self._sync_channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=HEALTH_TIMEOUT_S)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def stats(self) -> EngineStats:
        """One short blocking call per read (a Prometheus scrape), so a lost engine cannot stall the caller long."""
        return stats_from_proto(self.unary("GetStats", pb.GetStatsRequest(), timeout=STATS_TIMEOUT_S))

    def shutdown(self) -> None:
        """Cancel running calls and close the channels (the remote engine keeps running)."""
        for call in list(self._calls.values()):
            call.cancel()
        self._sync_channel.close()
        if self._aio is not None:
            loop, channel, _ = self._aio
            self._aio = None
            if loop.is_running():  # a stopped loop's channel dies with it
                with contextlib.suppress(RuntimeError):  # the loop closed between the check and the call
                    asyncio.run_coroutine_threadsafe(channel.close(), loop)

    # ------------------------------------------------------------------ plumbing
    def unary(self, method: str, request: Any, timeout: float = UNARY_TIMEOUT_S) -> Any:
        """One blocking call of the Engine service; gRPC errors become jengine errors."""
        try:
            return getattr(self._sync_stub, method)(request, metadata=self._metadata, timeout=timeout)
        except grpc.RpcError as exc:
            raise exception_from_rpc(exc) from None

    def _info(self) -> pb.GetModelInfoResponse:
        if self._model_info is None:
            self._model_info = self.unary("GetModelInfo", pb.GetModelInfoRequest())
        return self._model_info

    def _stub(self) -> pb_grpc.EngineStub:
        """The aio stub of the running loop; a new loop gets a new channel once no call runs on the old one."""
        loop = asyncio.get_running_loop()
        if self._aio is None or self._aio[0] is not loop:
            if self._calls:
                raise RuntimeError("this GrpcEngineClient is streaming on another event loop")
            channel = grpc.aio.insecure_channel(self._address, options=CHANNEL_OPTIONS)
            self._aio = (loop, channel, pb_grpc.EngineStub(channel))
        return self._aio[2]


def _generate_request(prompt: PromptInput, params: SamplingParams, request_id: str, priority: int
                      ) -> tuple[pb.GenerateRequest, str | None]:
    """The request message, plus the prompt text of a token-id prompt (kept locally: the wire carries one form)."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequestError(f"priority must be an integer, got {type(priority).__name__}", param="priority")
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling_to_proto(params), priority=priority,
                                 response_format=structured_to_proto(params.structured_outputs))
    return request, fill_prompt(request, prompt)


async def _stream_outputs(call: grpc.aio.UnaryStreamCall, decoder: OutputDecoder) -> AsyncIterator[RequestOutput]:
    async for msg in call:
        yield decoder.decode(msg)


# ------------------------------------------------------------------------------------------------- errors

_REMOTE_ERRORS: dict[str, type[JengineError]] = {
    name: cls for name, cls in vars(errors).items() if isinstance(cls, type) and issubclass(cls, JengineError)
}


def exception_from_rpc(exc: grpc.RpcError) -> JengineError:
    """The jengine error the server raised (from the trailers), else the error table's class for the status code."""
    code = exc.code()
    trailers = {k: v for k, v in (exc.trailing_metadata() or ()) if isinstance(v, str)}
    message = exc.details() or code.name.lower()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in message:
        cls = RequestTooLargeError  # gRPC's own message-size refusal: no trailers, and a retry would fail again
    else:
        cls = _REMOTE_ERRORS.get(trailers.get(ERROR_TYPE_KEY, "")) \
            or _class_for_status(code, trailers.get(ERROR_CODE_KEY))
    if cls is None:  # INTERNAL, UNKNOWN, UNIMPLEMENTED, a server-side CANCELLED: no jengine class to raise
        return JengineError(f"the remote engine failed: {code.name}: {message[:300]}")
    return _build(cls, message, trailers.get(ERROR_CODE_KEY), trailers.get(ERROR_PARAM_KEY))


def _class_for_status(code: grpc.StatusCode, error_code: str | None) -> type[JengineError] | None:
    """The table's rows for this status (most specific first): the one with this error code, else the most general."""
    rows = [(cls, kind) for cls, kind in ERROR_TABLE if kind.grpc_code == code.name and issubclass(cls, JengineError)]
    for cls, kind in rows:
        if kind.code == error_code:
            return cls
    return rows[-1][0] if rows else None


def _build(cls: type[JengineError], message: str, code: str | None, param: str | None) -> JengineError:
    """Each constructor's own keywords: code and param survive, so OpenAI error JSON is the same as in-process."""
    if issubclass(cls, InvalidRequestError):
        if cls is InvalidRequestError:
            return cls(message, param=param, code=code or "invalid_value")
        return cls(message, param=param)  # the subclasses fix their own code
    if issubclass(cls, NotFoundError):
        return cls(message, code=code or "model_not_found")
    return cls(message)


# ------------------------------------------------------------------------------------------------- tokenizer

class RemoteTokenizer:
    """The part of `jengine.tokenizer.Tokenizer` that front ends use, answered by the remote engine.

    Encoding and chat rendering go through Tokenize, decoding through Detokenize (blocking round trips); the ids and
    flags (vocab size, EOS, BOS, chat template presence) come with the model info, fetched once.
    """

    def __init__(self, client: GrpcEngineClient, info: pb.TokenizerInfo) -> None:
        self._client = client
        self._info = info
        self._token_text: dict[tuple[int, bool, bool], str] = {}  # one-token decodes; bounded by the vocabulary

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        reply = self._client.unary("Tokenize", pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens))
        return list(reply.token_ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, *,
               spaces_between_special_tokens: bool = True) -> str:
        """One round trip, except for a single token seen before: logprob rows decode token by token."""
        ids = list(ids)
        key = (ids[0], skip_special_tokens, spaces_between_special_tokens) if len(ids) == 1 else None
        if key is not None and key in self._token_text:
            return self._token_text[key]
        request = pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip_special_tokens,
                                       spaces_between_special_tokens=spaces_between_special_tokens)
        text = self._client.unary("Detokenize", request).text
        if key is not None:
            self._token_text[key] = text
        return text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings of `ids` (for /tokenize's token_strs)."""
        request = pb.DetokenizeRequest(token_ids=list(ids), return_token_strs=True)
        return list(self._client.unary("Detokenize", request).token_strs)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: Any = None, **template_kwargs: Any) -> str:
        """The rendered prompt text (`tools` listed by the template, as in-process)."""
        return self._tokenize_chat(messages, add_generation_prompt, continue_final_message, tools,
                                   template_kwargs).prompt

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: Any = None, **template_kwargs: Any) -> list[int]:
        return list(self._tokenize_chat(messages, add_generation_prompt, continue_final_message, tools,
                                        template_kwargs).token_ids)

    def _tokenize_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                       continue_final_message: bool, tools: Any, template_kwargs: dict[str, Any]
                       ) -> pb.TokenizeResponse:
        chat = messages_to_proto(messages, add_generation_prompt, continue_final_message, template_kwargs, tools)
        return self._client.unary("Tokenize", pb.TokenizeRequest(messages=chat, add_special_tokens=False))

    @property
    def vocab_size(self) -> int:
        return self._info.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self._info.eos_token_id if self._info.HasField("eos_token_id") else None

    @property
    def bos_token_id(self) -> int | None:
        return self._info.bos_token_id if self._info.HasField("bos_token_id") else None

    @property
    def pad_token_id(self) -> int | None:
        return self._info.pad_token_id if self._info.HasField("pad_token_id") else None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self._info.eos_token_ids)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._info.all_special_ids)

    @property
    def has_chat_template(self) -> bool:
        return self._info.has_chat_template
