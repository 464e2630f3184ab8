"""The engine streams of one HTTP request: admitted eagerly, merged, and closed together (closing aborts).

`EngineClient.generate` reserves the request's slots synchronously in its first step, so each stream's first step is
started as an eager task: a refusal (429, 400, 503) is known at once, before the next prompt of a batch is even
submitted, and before any HTTP response has started. The first output is awaited too, so errors the engine finds
while tokenising (context length, no chat template) still become proper HTTP statuses. Leaving the `async with`
for any reason (done, client gone, handler cancelled, error) aborts whatever still runs in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any

from jengine.clients.protocol import EngineClient
from jengine.outputs import RequestOutput
from jengine.lora.request import LoRARequest
from jengine.sampling.params import SamplingParams

_END = object()


async def _first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await anext(stream)


class RequestStreams:
    """One engine stream per prompt; iterate for (prompt index, delta output) in arrival order."""

    def __init__(self, streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput]) -> None:
        self._streams = streams
        self._firsts = firsts
        self._pumps: list[asyncio.Task[None]] = []
        self._iterator: Any = None

    @classmethod
    async def open(cls, client: EngineClient, prompts: Sequence[Any], params: SamplingParams, request_id: str,
                   priority: int = 0, lora_request: LoRARequest | None = None) -> RequestStreams:
        """Admit every prompt (stopping at the first refusal) and wait for each one's first output; with
        `lora_request`, under that adapter (the client is a `LoraClient` then)."""
        adapter = {} if lora_request is None else {"lora_request": lora_request}
        streams: list[AsyncIterator[RequestOutput]] = []
        tasks: list[asyncio.Task[RequestOutput]] = []
        loop = asyncio.get_running_loop()
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-p{i}"
                streams.append(client.generate(prompt, params, rid, priority=priority, **adapter))
                # Eager: the first step, and so the admission, runs right here, before the next prompt is submitted.
                tasks.append(asyncio.Task(_first(streams[-1]), loop=loop, eager_start=True))
                if tasks[-1].done() and tasks[-1].exception() is not None:
                    raise tasks[-1].exception()  # type: ignore[misc]
            firsts = list(await asyncio.gather(*tasks))
        except BaseException:
            await _close(tasks, streams)
            raise
        return cls(streams, firsts)

    async def __aenter__(self) -> RequestStreams:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._iterator is not None:
            await self._iterator.aclose()
        await _close(self._pumps, self._streams)

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        self._iterator = self._single() if len(self._streams) == 1 else self._merged()
        return self._iterator

    async def _single(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        yield 0, self._firsts[0]
        if not self._firsts[0].finished:
            async for output in self._streams[0]:
                yield 0, output

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all prompts as they come; an engine error in any stream ends the whole request."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        for i, first in enumerate(self._firsts):
            queue.put_nowait((i, first))
        running = [i for i, first in enumerate(self._firsts) if not first.finished]
        self._pumps = [asyncio.create_task(_pump(i, self._streams[i], queue)) for i in running]
        remaining = len(self._pumps)
        while remaining or not queue.empty():
            item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item


async def _pump(index: int, stream: AsyncIterator[RequestOutput], queue: asyncio.Queue[Any]) -> None:
    try:
        async for output in stream:
            queue.put_nowait((index, output))
    except Exception as exc:  # handed to the reader, who raises it in the handler
        queue.put_nowait(exc)
    finally:
        queue.put_nowait(_END)


async def _close(tasks: Sequence[asyncio.Task[Any]], streams: Sequence[AsyncIterator[RequestOutput]]) -> None:
    """Cancel the tasks driving the streams, wait for them, then close every stream (which aborts it)."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
    for stream in streams:
        await stream.aclose()  # type: ignore[attr-defined]
