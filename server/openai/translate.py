"""`RequestOutput`s → OpenAI response and stream-chunk JSON (completions and chat formats), plus SSE framing.

Pure functions and small accumulators, no I/O: the routes feed outputs in and write what comes out. Logprobs come in
two shapes, as OpenAI sends them: completions (`tokens`, `token_logprobs`, `top_logprobs` as {text: logprob} with the
chosen token beside the top-k, `text_offset`) and chat (`content`: one {token, logprob, bytes, top_logprobs} per token).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from server.errors import openai_error
from jengine.outputs import ChatMessage, CompletionOutput, Logprob, RequestOutput
from jengine.tools.request import ChatParsing
from jengine.tools.stream import MessageDelta, finish_reason

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way
DONE = b"data: [DONE]\n\n"
Decode = Callable[[int], str]


@dataclasses.dataclass(frozen=True)
class Decoders:
    """The tokenizer's two decodes the formats need: one token with specials shown (logprobs), and a whole prompt."""

    token: Decode
    ids: Callable[[list[int]], str]


@dataclasses.dataclass(frozen=True)
class ResponseMeta:
    """What every response and chunk of one request repeats."""

    id: str
    object: str  # "text_completion" | "chat.completion" (chunks: "chat.completion.chunk")
    created: int
    model: str
    system_fingerprint: str

    @classmethod
    def new(cls, kind: str, model: str, fingerprint: str, request_id: str | None = None) -> ResponseMeta:
        """`request_id` (the client's, as vLLM takes it) names the response; else a fresh random id."""
        prefix, obj = ("chatcmpl", "chat.completion") if kind == "chat" else ("cmpl", "text_completion")
        return cls(f"{prefix}-{request_id or uuid.uuid4().hex}", obj, int(time.time()), model, fingerprint)

    def head(self, *, chunk: bool = False) -> dict[str, Any]:
        obj = self.object + ".chunk" if chunk and self.object == "chat.completion" else self.object
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint}


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    return b"data: " + dumps(payload) + b"\n\n"


def dumps(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


# ---------------------------------------------------------------------------------------------------------- accumulate
@dataclasses.dataclass
class ChoiceTotals:
    """One choice so far: text, token ids, logprob dicts and how it ended."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class PromptTotals:
    """One prompt of the request: its ids and text, prompt logprobs gathered so far, prefix-cache hits."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str | None = None
    logprobs: list[dict[int, Logprob] | None] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0


class Accumulator:
    """Gathers delta outputs of one HTTP request (k prompts × n choices; choice index = prompt × n + choice)."""

    def __init__(self, num_prompts: int, n: int, *, drop_generated: bool = False) -> None:
        """`drop_generated`: the request scores its prompt only (echo with max_tokens 0, run with one token), so
        the generated token is left out of text, logprobs and usage."""
        self.n = n
        self.drop_generated = drop_generated
        self.prompts = [PromptTotals() for _ in range(num_prompts)]
        self.choices = [ChoiceTotals() for _ in range(num_prompts * n)]

    def add(self, prompt_index: int, output: RequestOutput) -> list[tuple[int, CompletionOutput]]:
        """Apply one delta output; returns (choice index, delta) pairs for whoever streams them."""
        prompt = self.prompts[prompt_index]
        prompt.token_ids, prompt.num_cached_tokens = output.prompt_token_ids, output.num_cached_tokens
        prompt.text = output.prompt if output.prompt is not None else prompt.text
        prompt.logprobs.extend(output.prompt_logprobs or ())
        deltas = []
        for delta in output.outputs:
            if self.drop_generated:
                delta = dataclasses.replace(delta, text="", token_ids=[], cumulative_logprob=None, logprobs=None)
            index = prompt_index * self.n + delta.index
            choice = self.choices[index]
            choice.text += delta.text
            choice.token_ids.extend(delta.token_ids)
            choice.logprobs.extend(delta.logprobs or ())
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
            deltas.append((index, delta))
        return deltas

    def unfinished(self) -> list[int]:
        return [i for i, c in enumerate(self.choices) if c.finish_reason is None]

    def usage(self) -> dict[str, Any]:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(p.num_cached_tokens for p in self.prompts)}}


# ---------------------------------------------------------------------------------------------------------- logprobs
@dataclasses.dataclass(frozen=True)
class TokenRow:
    """One position's logprobs, format-neutral: the token's text and logprob, and the candidates in rank order."""

    text: str
    logprob: float | None  # None: the first prompt token (nothing predicts it)
    candidates: list[tuple[str, float, int | None]]  # (text, logprob, rank) — chosen first, then ranks 1..k


def sampled_rows(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], decode: Decode) -> list[TokenRow]:
    """Rows of generated tokens (the chosen token looked up by id, so dict order is not relied on)."""
    return [_row(token, entry, decode) for token, entry in zip(token_ids, entries)]


def prompt_rows(prompt: PromptTotals, decode: Decode) -> list[TokenRow]:
    """Rows of the prompt for echo: the first token has no logprob."""
    rows = []
    for position, token in enumerate(prompt.token_ids):
        entry = prompt.logprobs[position] if position < len(prompt.logprobs) else None
        rows.append(TokenRow(decode(token), None, []) if entry is None else _row(token, entry, decode))
    return rows


def _row(token: int, entry: dict[int, Logprob], decode: Decode) -> TokenRow:
    chosen = entry.get(token)
    text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else decode(token)
    candidates = [(lp.decoded_token if lp.decoded_token is not None else decode(tid), _finite(lp.logprob), lp.rank)
                  for tid, lp in entry.items()]
    logprob = _finite(chosen.logprob) if chosen is not None else MIN_LOGPROB
    return TokenRow(text, logprob, candidates)


def completion_logprobs(rows: Sequence[TokenRow], start_offset: int) -> dict[str, Any]:
    """OpenAI's completions shape; `text_offset` counts characters from the start of the choice's text."""
    offsets, offset = [], start_offset
    for row in rows:
        offsets.append(offset)
        offset += len(row.text)
    return {
        "tokens": [r.text for r in rows],
        "token_logprobs": [r.logprob for r in rows],
        "top_logprobs": [None if r.logprob is None else {t: lp for t, lp, _ in reversed(r.candidates)}
                         for r in rows],  # reversed: where two ids decode alike, the chosen one's value wins
        "text_offset": offsets,
    }


def chat_logprobs(rows: Sequence[TokenRow], top: int) -> dict[str, Any]:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [k most likely]}]}."""
    return {"content": [_chat_token(r, top) for r in rows], "refusal": None}


def _chat_token(row: TokenRow, top: int) -> dict[str, Any]:
    ranked = sorted((c for c in row.candidates if c[2] is not None and 1 <= c[2] <= top), key=lambda c: c[2])
    seen: set[int] = set()
    tops = []
    for text, logprob, rank in ranked:
        if rank not in seen:
            seen.add(rank)
            tops.append({"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))})
    return {"token": row.text, "logprob": row.logprob if row.logprob is not None else MIN_LOGPROB,
            "bytes": list(row.text.encode("utf-8")), "top_logprobs": tops}


def prompt_logprobs_json(prompt: PromptTotals, shown: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` extra: per position None or {token id: {logprob, rank, decoded_token}}: the prompt's
    own token and the `shown` most likely (echo may have computed more)."""
    return [None if entry is None else
            {str(tid): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in entry.items() if lp.rank <= shown or tid == token}
            for entry, token in zip(prompt.logprobs, prompt.token_ids)]


# ---------------------------------------------------------------------------------------------------------- responses
def completion_choice(index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None,
                      stop_reason: int | str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def completion_response(meta: ResponseMeta, acc: Accumulator, echo: bool, logprobs: int | None,
                        shown_prompt_logprobs: int | None, decoders: Decoders) -> dict[str, Any]:
    """The whole /v1/completions answer (non-streaming)."""
    choices = []
    for index, choice in enumerate(acc.choices):
        prompt = acc.prompts[index // acc.n]
        prefix = echo_text(prompt, decoders) if echo else ""
        block = None
        if logprobs is not None:
            rows = prompt_rows(prompt, decoders.token) if echo else []
            block = completion_logprobs(rows + sampled_rows(choice.token_ids, choice.logprobs, decoders.token), 0)
        item = completion_choice(index, prefix + choice.text, block, choice.finish_reason, choice.stop_reason)
        if shown_prompt_logprobs is not None:
            item["prompt_logprobs"] = prompt_logprobs_json(prompt, shown_prompt_logprobs)
        choices.append(item)
    return {**meta.head(), "choices": choices, "usage": acc.usage()}


def echo_text(prompt: PromptTotals, decoders: Decoders) -> str:
    """The prompt as text for `echo`: the given text, or the ids decoded."""
    return prompt.text if prompt.text is not None else decoders.ids(prompt.token_ids)


def chat_response(meta: ResponseMeta, acc: Accumulator, top_logprobs: int | None,
                  shown_prompt_logprobs: int | None, decoders: Decoders, parsing: ChatParsing | None = None
                  ) -> dict[str, Any]:
    """The whole /v1/chat/completions answer (non-streaming); `parsing` reads reasoning and tool calls out of the
    text."""
    choices = []
    for index, choice in enumerate(acc.choices):
        block = None
        if top_logprobs is not None:
            block = chat_logprobs(sampled_rows(choice.token_ids, choice.logprobs, decoders.token), top_logprobs)
        message, parsed = {"role": "assistant", "content": choice.text}, None
        if parsing is not None:
            parsed = parsing.read(acc.prompts[0].text, choice.text)
            message = message_json(parsed, parsing)
        choices.append({"index": index, "message": message, "logprobs": block,
                        "finish_reason": finish_reason(choice.finish_reason, parsed),
                        "stop_reason": choice.stop_reason})
    body = {**meta.head(), "choices": choices, "usage": acc.usage()}
    if shown_prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(acc.prompts[0], shown_prompt_logprobs)
    return body


def message_json(message: ChatMessage, parsing: ChatParsing) -> dict[str, Any]:
    """A parsed assistant message as OpenAI (and vLLM) shape it: the reasoning under both of vLLM's names."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if parsing.reasoning_parser is not None and parsing.include_reasoning:
        out["reasoning"] = out["reasoning_content"] = message.reasoning
    if parsing.tool_call_parser is not None or message.tool_calls:
        out["tool_calls"] = [call.to_openai() for call in message.tool_calls]
    return out


def delta_json(delta: MessageDelta, include_reasoning: bool = True) -> dict[str, Any]:
    """A stream chunk's `delta` of a parsed choice: only what it gained (no reasoning unless included)."""
    out: dict[str, Any] = {}
    if delta.reasoning and include_reasoning:
        out["reasoning"] = out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = [call.to_openai() for call in delta.tool_calls]
    return out


# ---------------------------------------------------------------------------------------------------------- chunks
def chunk(meta: ResponseMeta, choices: list[dict[str, Any]], usage: dict[str, Any] | None,
          with_usage: bool) -> dict[str, Any]:
    """One stream chunk; with include_usage every chunk has a `usage` key (null but in the last)."""
    body = {**meta.head(chunk=True), "choices": choices}
    if with_usage:
        body["usage"] = usage
    return body


def chat_delta_choice(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
                      finish_reason: str | None = None, stop_reason: int | str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def error_chunk(meta: ResponseMeta, indices: Sequence[int], exc: BaseException, chat: bool) -> dict[str, Any]:
    """The last chunk of a stream that failed after it started: finish_reason "error" and the error object."""
    if chat:
        choices = [chat_delta_choice(i, {}, finish_reason="error") for i in indices]
    else:
        choices = [completion_choice(i, "", None, "error", None) for i in indices]
    return {**meta.head(chunk=True), "choices": choices, "error": openai_error(exc)}
