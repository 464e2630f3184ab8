"""The OpenAI-compatible routes over one `EngineClient`: parse → admit → stream or collect → JSON / SSE.

Errors are raised as the `jengine.errors` hierarchy and rendered once, by the app's error middleware, through
`server/errors.py`; only an error after a stream has started is written here (as a final chunk, then `[DONE]`).
A generation that outlives the server's request timeout is aborted in the engine and ends the same way: 504 before
the response has started, a final error chunk after.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from jengine.clients.protocol import EngineClient
from jengine.tokenizer.chat import chat_text
from jengine.errors import DeadlineExceededError, JengineError, NotFoundError, RequestTooLargeError
from jengine.tokenizer import NoChatTemplateError
from server.openai.chunks import ChatStreamFormatter, CompletionStreamFormatter, StreamFormatter
from server.openai.protocol import (
    ChatRequest, CompletionRequest, parse_chat, parse_completion, parse_detokenize, parse_json_body, parse_tokenize,
)
from server.openai.streams import RequestStreams
from server.openai.translate import DONE, Accumulator, Decoders, ResponseMeta, chat_response, completion_response, \
    dumps, sse

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(payload), status=status, headers=headers, content_type="application/json")


async def read_json(request: web.Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; a declared or actual size over `max_bytes` is a 413 before parsing."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise RequestTooLargeError(f"the request body is {request.content_length} bytes; the limit is {max_bytes}")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestTooLargeError(f"the request body is over the limit of {max_bytes} bytes") from None
    return parse_json_body(raw)


class OpenAIRoutes:
    """Handlers bound to one client; the model's limits are read once (they do not change while serving)."""

    def __init__(self, client: EngineClient, *, fingerprint: str, max_n: int, max_body_bytes: int,
                 request_timeout: float | None = None) -> None:
        self.client = client
        self.request_timeout = request_timeout  # seconds per generation request; None: no limit
        self.info = client.get_model_info()
        self.tokenizer = client.get_tokenizer()
        self.fingerprint = fingerprint
        self.max_n = max_n
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        tokenizer = self.tokenizer
        self.decoders = Decoders(lambda t: tokenizer.decode([t], skip_special_tokens=False), tokenizer.decode)

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)

    # ------------------------------------------------------------------ generation
    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_completion(await read_json(request, self.max_body_bytes), self.info, self.max_n)
        self._check_model(parsed.model)
        meta = ResponseMeta.new("completion", self.info.name, self.fingerprint, parsed.request_id)
        acc = Accumulator(len(parsed.prompts), parsed.params.n, drop_generated=parsed.echo_only)
        formatter = CompletionStreamFormatter(meta, acc, parsed, self.decoders) if parsed.stream else None
        streamed = await self._generate(request, parsed.prompts, parsed, meta, acc, formatter)
        return streamed or json_response(completion_response(
            meta, acc, parsed.echo, parsed.logprobs, parsed.shown_prompt_logprobs, self.decoders))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_chat(await read_json(request, self.max_body_bytes), self.info, self.max_n)
        self._check_model(parsed.model)
        if not self.tokenizer.has_chat_template:
            raise NoChatTemplateError()  # before admission: the engine would only refuse it after tokenising
        meta = ResponseMeta.new("chat", self.info.name, self.fingerprint, parsed.request_id)
        acc = Accumulator(1, parsed.params.n)
        formatter = ChatStreamFormatter(meta, acc, parsed, self.decoders) if parsed.stream else None
        streamed = await self._generate(request, [parsed.prompt], parsed, meta, acc, formatter)
        return streamed or json_response(chat_response(
            meta, acc, parsed.top_logprobs, parsed.shown_prompt_logprobs, self.decoders))

    async def _generate(self, request: web.Request, prompts: list[Any], parsed: ChatRequest | CompletionRequest,
                        meta: ResponseMeta, acc: Accumulator, formatter: StreamFormatter | None
                        ) -> web.StreamResponse | None:
        """Admit, then stream SSE (returns the response) or gather every output into `acc` (returns None).

        Past the deadline the engine's streams are closed (which aborts them) and the client hears 504 `timeout`."""
        deadline = None if self.request_timeout is None else asyncio.get_running_loop().time() + self.request_timeout
        try:
            async with asyncio.timeout_at(deadline):
                streams = await RequestStreams.open(self.client, prompts, parsed.params, meta.id, parsed.priority)
                if formatter is None:
                    async with streams:
                        async for index, output in streams:
                            acc.add(index, output)
                    return None
        except TimeoutError as exc:
            raise self._timed_out(exc) from None
        async with streams:
            return await _stream(request, streams, formatter, deadline, self._timed_out)

    def _timed_out(self, exc: TimeoutError) -> DeadlineExceededError:
        """The client's error for a passed deadline (an engine's own deadline error is kept as it is)."""
        if isinstance(exc, DeadlineExceededError):
            return exc
        return DeadlineExceededError(f"the request did not finish within the server's request timeout "
                                     f"({self.request_timeout:g} s); it was aborted")

    # ------------------------------------------------------------------ models and tokens
    async def list_models(self, request: web.Request) -> web.Response:
        names = (self.info.name, *self.info.aliases)
        return json_response({"object": "list", "data": [self._model_card(name) for name in names]})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        self._check_model(name)
        return json_response(self._model_card(name))

    async def tokenize(self, request: web.Request) -> web.Response:
        fields = parse_tokenize(await read_json(request, self.max_body_bytes))
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
        return json_response(payload)

    async def detokenize(self, request: web.Request) -> web.Response:
        model, tokens = parse_detokenize(await read_json(request, self.max_body_bytes), self.info.vocab_size)
        self._check_model(model)
        return json_response({"prompt": self.tokenizer.decode(tokens)})

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "jengine",
                "root": self.info.name, "parent": None, "max_model_len": self.info.max_model_len}

    def _check_model(self, model: str | None) -> None:
        """An absent model means the served one (vLLM's habit), as does any of its names; another is a 404."""
        if model is not None and model != self.info.name and model not in self.info.aliases:
            raise NotFoundError(f"the model {model[:100]!r} does not exist; this server serves {self.info.name!r}")


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
    except Exception as exc:
        if isinstance(exc, TimeoutError):
            exc = timed_out(exc)
        logger.warning("stream %s failed after it started: %s", formatter.meta.id, type(exc).__name__,
                       exc_info=not isinstance(exc, JengineError))
        tail = sse(formatter.error_chunk(exc)) + DONE
    try:
        await response.write(tail)
        await response.write_eof()
    except ConnectionError:
        pass
    return response


async def _write_chunks(response: web.StreamResponse, streams: RequestStreams, formatter: StreamFormatter) -> None:
    for payload in formatter.start():
        await response.write(sse(payload))
    async for index, output in streams:
        for payload in formatter.on_output(index, output):
            await response.write(sse(payload))
    usage = formatter.usage_chunk()
    if usage is not None:
        await response.write(sse(usage))
