"""The OpenAI-compatible routes over one `EngineClient`: parse → admit → stream or collect → JSON / SSE.

Errors are raised as the `jengine.errors` hierarchy and rendered once, by the app's error middleware, through
`server/errors.py`; only an error after a stream has started is written here (as a final chunk, then `[DONE]`).
A generation that outlives the server's request timeout is aborted in the engine and ends the same way: 504 before
the response has started, a final error chunk after.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from jengine.clients.protocol import EngineClient, LoraClient
from jengine.lora.request import LoRARequest
from jengine.errors import (
    DeadlineExceededError, InvalidRequestError, JengineError, NotFoundError, RequestTooLargeError,
    ServiceUnavailableError,
)
from jengine.tokenizer.chat import chat_text
from jengine.tokenizer import NoChatTemplateError
from server.errors import openai_error_body
from server.json_body import parse_json_body
from server.openai.lora_routes import LoraRoutes
from server.openai.chunks import ChatStreamFormatter, CompletionStreamFormatter, StreamFormatter
from server.openai.protocol import (
    ChatRequest, CompletionRequest, parse_chat, parse_completion, parse_detokenize, parse_tokenize,
)
from server.openai.streams import RequestStreams
from server.openai.translate import DONE, Accumulator, Decoders, ResponseMeta, chat_response, completion_response, \
    dumps, sse
from server.request_work import RequestWork, encode_json, prepare_prompts

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return encoded_json_response(dumps(payload), status, headers)


def encoded_json_response(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=body, status=status, headers=headers, content_type="application/json")


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    """The body as sent (decompressed); a declared or actual size over `max_bytes` is a 413, a body that does not
    decode as its Content-Encoding says a 400."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise RequestTooLargeError(f"the request body is {request.content_length} bytes; the limit is {max_bytes}")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestTooLargeError(f"the request body is over the limit of {max_bytes} bytes "
                                   f"(after decompression)") from None
    except (HttpProcessingError, RequestPayloadError):  # e.g. Content-Encoding: gzip on bytes that are not gzip
        raise InvalidRequestError("the request body does not decode as its Content-Encoding says") from None


class OpenAIRoutes:
    """Handlers bound to one client; the model's limits are read once (they do not change while serving)."""

    def __init__(self, client: EngineClient, work: RequestWork, *, fingerprint: str, max_n: int,
                 max_body_bytes: int, request_timeout: float | None = None, lora: LoraClient | None = None) -> None:
        """`lora`: the client that serves adapters (requests then name them in `model`), else None."""
        self.client = client
        self.work = work  # parsing, tokenizing and response encoding run there, off the event loop
        self.request_timeout = request_timeout  # seconds per generation request; None: no limit
        self.info = client.get_model_info()
        self.tokenizer = client.get_tokenizer()
        self.fingerprint = fingerprint
        self.max_n = max_n
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self._streaming: set[asyncio.Task[Any]] = set()  # handlers writing an SSE stream now (what a drain cuts)
        tokenizer = self.tokenizer
        self.decoders = Decoders(lambda t: tokenizer.decode([t], skip_special_tokens=False), tokenizer.decode)
        self.adapters = LoraRoutes(lora, self.info.name, self.created,
                                   lambda request: read_body(request, self.max_body_bytes))

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        self.adapters.register(app)

    # ------------------------------------------------------------------ generation
    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed = await self._parse(request, parse_completion)
        lora = self._check_model(parsed.model)
        prompts = await self.work.run(prepare_prompts, self.tokenizer, self.info, parsed.prompts, parsed.params)
        meta = ResponseMeta.new("completion", self.info.name, self.fingerprint, parsed.request_id)
        acc = Accumulator(len(parsed.prompts), parsed.params.n, drop_generated=parsed.echo_only)
        formatter = CompletionStreamFormatter(meta, acc, parsed, self.decoders) if parsed.stream else None
        streamed = await self._generate(request, prompts, parsed, meta, acc, formatter, lora)
        return streamed or await self._encoded(completion_response, meta, acc, parsed.echo, parsed.logprobs,
                                               parsed.shown_prompt_logprobs, self.decoders)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        parsed = await self._parse(request, parse_chat)
        lora = self._check_model(parsed.model)
        if not self.tokenizer.has_chat_template:
            raise NoChatTemplateError()  # before any template work
        prompts = await self.work.run(prepare_prompts, self.tokenizer, self.info, [parsed.prompt], parsed.params)
        meta = ResponseMeta.new("chat", self.info.name, self.fingerprint, parsed.request_id)
        acc = Accumulator(1, parsed.params.n)
        formatter = ChatStreamFormatter(meta, acc, parsed, self.decoders) if parsed.stream else None
        streamed = await self._generate(request, prompts, parsed, meta, acc, formatter, lora)
        return streamed or await self._encoded(chat_response, meta, acc, parsed.top_logprobs,
                                               parsed.shown_prompt_logprobs, self.decoders, parsed.parsing)

    async def _parse(self, request: web.Request, parse: Callable[..., Any]) -> Any:
        """The body read, then decoded and checked by `parse` on the work pool (a 4 MB body takes a while)."""
        raw = await read_body(request, self.max_body_bytes)
        return await self.work.run(lambda: parse(parse_json_body(raw), self.info, self.max_n))

    async def _encoded(self, build: Callable[..., Any], *args: Any) -> web.Response:
        """A whole response built and encoded on the work pool (with echo and logprobs it can be megabytes)."""
        return encoded_json_response(await self.work.run(lambda: encode_json(build(*args))))

    async def _generate(self, request: web.Request, prompts: list[Any], parsed: ChatRequest | CompletionRequest,
                        meta: ResponseMeta, acc: Accumulator, formatter: StreamFormatter | None,
                        lora: LoRARequest | None = None) -> web.StreamResponse | None:
        """Admit, then stream SSE (returns the response) or gather every output into `acc` (returns None).

        Past the deadline the engine's streams are closed (which aborts them) and the client hears 504 `timeout`."""
        deadline = None if self.request_timeout is None else asyncio.get_running_loop().time() + self.request_timeout
        try:
            async with asyncio.timeout_at(deadline):
                streams = await RequestStreams.open(self.client, prompts, parsed.params, meta.id, parsed.priority,
                                                    lora)
                if formatter is None:
                    async with streams:
                        async for index, output in streams:
                            acc.add(index, output)
                    return None
        except TimeoutError as exc:
            raise self._timed_out(exc) from None
        task = asyncio.current_task()
        assert task is not None
        self._streaming.add(task)
        try:
            async with streams:
                return await _stream(request, streams, formatter, deadline, self._timed_out)
        finally:
            self._streaming.discard(task)

    async def cut_streams(self, grace: float = 1.0) -> None:
        """End every stream still being written (the drain timeout passed): each sends its final error chunk and
        `[DONE]` within `grace` seconds, before the connections close."""
        tasks = list(self._streaming)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=grace)

    def _timed_out(self, exc: TimeoutError) -> DeadlineExceededError:
        """The client's error for a passed deadline (an engine's own deadline error is kept as it is)."""
        if isinstance(exc, DeadlineExceededError):
            return exc
        return DeadlineExceededError(f"the request did not finish within the server's request timeout "
                                     f"({self.request_timeout:g} s); it was aborted")

    # ------------------------------------------------------------------ models and tokens
    async def list_models(self, request: web.Request) -> web.Response:
        names = (self.info.name, *self.info.aliases)
        cards = [self._model_card(name) for name in names] + self.adapters.cards()
        return json_response({"object": "list", "data": cards})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if self._check_model(name) is not None:
            return json_response(next(c for c in self.adapters.cards() if c["id"] == name))
        return json_response(self._model_card(name))

    async def tokenize(self, request: web.Request) -> web.Response:
        raw = await read_body(request, self.max_body_bytes)
        return encoded_json_response(await self.work.run(self._tokenize, raw))

    def _tokenize(self, raw: bytes) -> bytes:
        """/tokenize's whole work (on the work pool): parse, render, encode, and the response JSON."""
        fields = parse_tokenize(parse_json_body(raw))
        self._check_model(fields["model"])
        if "messages" in fields:
            if not self.tokenizer.has_chat_template:
                raise NoChatTemplateError()
            text = chat_text(self.tokenizer, fields["messages"], fields["chat"])
        else:
            text = fields["prompt"]
        ids = self.tokenizer.encode(text, add_special_tokens=fields["add_special_tokens"])
        payload: dict[str, Any] = {"count": len(ids), "max_model_len": self.info.max_model_len, "tokens": ids}
        if fields["return_token_strs"]:
            payload["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return encode_json(payload)

    async def detokenize(self, request: web.Request) -> web.Response:
        raw = await read_body(request, self.max_body_bytes)
        return encoded_json_response(await self.work.run(self._detokenize, raw))

    def _detokenize(self, raw: bytes) -> bytes:
        model, tokens = parse_detokenize(parse_json_body(raw), self.info.vocab_size)
        self._check_model(model)
        return encode_json({"prompt": self.tokenizer.decode(tokens)})

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "jengine",
                "root": self.info.name, "parent": None, "max_model_len": self.info.max_model_len}

    def _check_model(self, model: str | None) -> LoRARequest | None:
        """An absent model means the served one (vLLM's habit), as does any of its names; an adapter's name means
        that adapter (returned); another is a 404."""
        if model is None or model == self.info.name or model in self.info.aliases:
            return None
        lora = self.adapters.resolve(model)
        if lora is None:
            raise NotFoundError(f"the model {model[:100]!r} does not exist; this server serves {self.info.name!r}")
        return lora


async def _stream(request: web.Request, streams: RequestStreams, formatter: StreamFormatter, deadline: float | None,
                  timed_out: Callable[[TimeoutError], DeadlineExceededError]) -> web.StreamResponse:
    """Write SSE chunks as outputs arrive, then `[DONE]`; a client that goes away ends it (the streams are aborted
    by the caller's `async with`). An engine error, or the deadline, after the status went out travels as a last
    chunk."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    tail = DONE
    try:
        async with asyncio.timeout_at(deadline):
            await _write_chunks(response, streams, formatter)
    except ConnectionError:
        logger.debug("client went away mid-stream")
        return response
    except asyncio.CancelledError:  # the server closes (drain timeout) or the client left: end the stream properly
        await _end(response, _error_tail(formatter, ServiceUnavailableError(
            "the server closed this stream before it finished (it is shutting down); retry on another replica")))
        raise
    except Exception as exc:
        if isinstance(exc, TimeoutError):
            exc = timed_out(exc)
        logger.warning("stream %s failed after it started: %s", formatter.meta.id, type(exc).__name__,
                       exc_info=not isinstance(exc, JengineError))
        tail = _error_tail(formatter, exc)
    await _end(response, tail)
    return response


def _error_tail(formatter: StreamFormatter, exc: BaseException) -> bytes:
    """The final error chunk and `[DONE]`; should the chunk itself not encode, the error alone (ASCII-escaped), so a
    stream whose headers went out never ends in anything but SSE."""
    try:
        return sse(formatter.error_chunk(exc)) + DONE
    except Exception:
        logger.exception("the error chunk of stream %s does not encode", formatter.meta.id)
        return b"data: " + json.dumps(openai_error_body(exc)).encode("ascii") + b"\n\n" + DONE


async def _end(response: web.StreamResponse, tail: bytes) -> None:
    try:
        await response.write(tail)
        await response.write_eof()
    except (ConnectionError, RuntimeError):  # the client is gone, or the transport already closed
        pass


async def _write_chunks(response: web.StreamResponse, streams: RequestStreams, formatter: StreamFormatter) -> None:
    for payload in formatter.start():
        await response.write(sse(payload))
    async for index, output in streams:
        for payload in formatter.on_output(index, output):
            await response.write(sse(payload))
    usage = formatter.usage_chunk()
    if usage is not None:
        await response.write(sse(usage))
