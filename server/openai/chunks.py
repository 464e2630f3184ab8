"""Stream chunks of one request, as OpenAI sends them: chat (`delta`s, a role chunk first) and completions (`text`).

A formatter owns the request's `Accumulator` and turns each delta `RequestOutput` into zero or more chunk JSONs; the
route frames them as SSE, then adds the usage chunk (`stream_options.include_usage`) and `[DONE]`. Deltas that carry
nothing a client can see (text held back for a possible stop string, a partial UTF-8 character) make no chunk.
"""

from __future__ import annotations

from typing import Any

from jengine.outputs import CompletionOutput, RequestOutput
from jengine.tools.stream import ChoiceParsers
from server.openai.protocol import ChatRequest, CompletionRequest, StreamOptions
from server.openai.translate import (
    Accumulator, Decoders, ResponseMeta, chat_delta_choice, chat_logprobs, chunk, completion_choice,
    completion_logprobs, delta_json, echo_text, error_chunk, prompt_rows, sampled_rows,
)


class StreamFormatter:
    """What chat and completions share: usage and error chunks, and the `usage` key rules."""

    chat = False

    def __init__(self, meta: ResponseMeta, acc: Accumulator, options: StreamOptions, decoders: Decoders) -> None:
        self.meta = meta
        self.acc = acc
        self.options = options
        self.decoders = decoders

    def start(self) -> list[dict[str, Any]]:
        """Chunks sent before any output (chat: the assistant role of each choice)."""
        return []

    def on_output(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        chunks = []
        for index, delta in self.acc.add(prompt_index, output):
            choice = self._choice(index, delta)
            if choice is not None:
                chunks.append(self._chunk([choice]))
        return chunks

    def usage_chunk(self) -> dict[str, Any] | None:
        """The final chunk with no choices and the whole request's usage (only with include_usage)."""
        if not self.options.include_usage:
            return None
        return chunk(self.meta, [], self.acc.usage(), True)

    def error_chunk(self, exc: BaseException) -> dict[str, Any]:
        return error_chunk(self.meta, self.acc.unfinished(), exc, self.chat)

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        with_usage = self.options.include_usage or self.options.continuous_usage_stats
        usage = self.acc.usage() if self.options.continuous_usage_stats else None
        return chunk(self.meta, choices, usage, with_usage)

    def _choice(self, index: int, delta: CompletionOutput) -> dict[str, Any] | None:
        raise NotImplementedError


class ChatStreamFormatter(StreamFormatter):
    chat = True

    def __init__(self, meta: ResponseMeta, acc: Accumulator, request: ChatRequest, decoders: Decoders) -> None:
        super().__init__(meta, acc, request.stream_options, decoders)
        self.top_logprobs = request.top_logprobs
        self.parsers = None if request.parsing is None else ChoiceParsers(request.parsing.choice)
        self.include_reasoning = request.parsing is None or request.parsing.include_reasoning

    def start(self) -> list[dict[str, Any]]:
        return [self._chunk([chat_delta_choice(i, {"role": "assistant", "content": ""})])
                for i in range(len(self.acc.choices))]

    def _choice(self, index: int, delta: CompletionOutput) -> dict[str, Any] | None:
        block = None
        if self.top_logprobs is not None and delta.token_ids:
            rows = sampled_rows(delta.token_ids, delta.logprobs or [], self.decoders.token)
            block = chat_logprobs(rows, self.top_logprobs)
        if self.parsers is not None:
            return self._parsed_choice(index, delta, block)
        if not delta.text and block is None and delta.finish_reason is None:
            return None
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        return chat_delta_choice(index, content, block, delta.finish_reason, delta.stop_reason)

    def _parsed_choice(self, index: int, delta: CompletionOutput, block: dict[str, Any] | None
                       ) -> dict[str, Any] | None:
        """The delta as the choice's parser reads it: reasoning, content and tool-call deltas apart."""
        assert self.parsers is not None
        prompt = self.acc.prompts[index // self.acc.n].text
        read, reason = self.parsers.feed(index, prompt, delta.text, delta.finish_reason)
        fields = delta_json(read, self.include_reasoning)
        if not fields and block is None and reason is None:
            return None
        return chat_delta_choice(index, fields, block, reason, delta.stop_reason)


class CompletionStreamFormatter(StreamFormatter):
    def __init__(self, meta: ResponseMeta, acc: Accumulator, request: CompletionRequest, decoders: Decoders) -> None:
        super().__init__(meta, acc, request.stream_options, decoders)
        self.echo = request.echo
        self.logprobs = request.logprobs
        self._started: set[int] = set()  # choices whose first chunk (with the echo) has gone out
        self._offsets = [0] * len(acc.choices)  # token-text characters sent per choice, for text_offset

    def _choice(self, index: int, delta: CompletionOutput) -> dict[str, Any] | None:
        text, rows = delta.text, []
        if self.echo and index not in self._started:
            prompt = self.acc.prompts[index // self.acc.n]
            text = echo_text(prompt, self.decoders) + text
            rows = prompt_rows(prompt, self.decoders.token) if self.logprobs is not None else []
        self._started.add(index)
        block = None
        if self.logprobs is not None:
            rows += sampled_rows(delta.token_ids, delta.logprobs or [], self.decoders.token)
            block = completion_logprobs(rows, self._offsets[index]) if rows else None
            self._offsets[index] += sum(len(row.text) for row in rows)  # as the whole response counts them
        if not text and block is None and delta.finish_reason is None:
            return None
        return completion_choice(index, text, block, delta.finish_reason, delta.stop_reason)
