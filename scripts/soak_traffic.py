"""The soak's traffic: one kind of request per function, each ending in exactly one ledger outcome.

Outcomes: `ok` (a whole answer: 200 with choices, or a stream that ended with a finish reason and `[DONE]`),
`refused` (429 when the engine is full, or the 4xx a bad input must get), `cancelled` (the client gave up: closed a
stream mid-way or stopped waiting), `errored` (anything else: a 5xx, an error chunk, a bad input answered 200, a broken
connection). A request that gets no answer within the timeout is none of these: it is lost.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

_LINE_END = re.compile(r"\r\n|\r|\n")
OUTCOMES = ("ok", "refused", "cancelled", "errored")
WORDS = ("the", "engine", "streams", "tokens", "über", "naïve", "日本", "cache", "block", "prefill", "decode",
         "🙂", "quick", "brown", "fox", "jumps", "lazy", "dog", "serve", "batch")


@dataclasses.dataclass
class Ledger:
    """sent = ok + refused + cancelled + errored + lost; every request is counted as sent before it leaves."""

    sent: int = 0
    outcomes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    by_kind: dict[str, collections.Counter[str]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    timed_out: int = 0
    error_samples: list[str] = dataclasses.field(default_factory=list)

    def record(self, kind: str, outcome: str, detail: str = "") -> None:
        self.outcomes[outcome] += 1
        self.by_kind[kind][outcome] += 1
        if outcome == "errored" and len(self.error_samples) < 20:
            self.error_samples.append(f"{kind}: {detail[:300]}")

    @property
    def lost(self) -> int:
        return self.sent - sum(self.outcomes[name] for name in OUTCOMES)

    def summary(self) -> dict[str, Any]:
        return {"sent": self.sent, **{name: self.outcomes[name] for name in OUTCOMES}, "lost": self.lost,
                "timed_out": self.timed_out, "by_kind": {k: dict(v) for k, v in sorted(self.by_kind.items())},
                "error_samples": self.error_samples}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the traffic goes and what it may ask for."""

    model: str
    max_prompt_words: int = 30
    max_tokens: int = 32


def prompt(rng: random.Random, target: Target) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, target.max_prompt_words)))


def messages(rng: random.Random, target: Target) -> list[dict[str, str]]:
    turns = [{"role": "system", "content": "You are terse."}] if rng.random() < 0.3 else []
    return turns + [{"role": "user", "content": prompt(rng, target)}]


def by_status(status: int, body: bytes, *, bad_input: bool = False) -> tuple[str, str]:
    """(outcome, detail) of a whole (non-streamed) answer."""
    if status == 429 and not bad_input:
        return "refused", ""
    if bad_input:
        good = 400 <= status < 500 and b'"error"' in body
        return ("refused", "") if good else ("errored", f"bad input got {status}: {body[:200]!r}")
    if status == 200 and b'"choices"' in body:
        return "ok", ""
    return "errored", f"status {status}: {body[:200]!r}"


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """Lines as SSE splits them: at \\n, \\r\\n or \\r only. (httpx's aiter_lines splits like str.splitlines, also at
    U+2028, U+0085 and the like, which a model's text holds raw inside a JSON string.)"""
    buffer = ""
    async for text in response.aiter_text():
        *lines, buffer = _LINE_END.split(buffer + text)
        for line in lines:
            yield line
    if buffer:
        yield buffer


async def read_stream(response: httpx.Response, stop_after: int | None = None) -> tuple[str, str]:
    """Reads SSE events; closes early after `stop_after` data chunks (a client disconnecting mid-stream)."""
    if response.status_code != 200:
        return by_status(response.status_code, await response.aread())
    chunks, finished, done = 0, False, False
    async for line in sse_lines(response):
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return "errored", f"error chunk: {line[:200]}"
        chunks += 1
        finished = finished or any(c.get("finish_reason") for c in chunk.get("choices", []))
        if stop_after is not None and chunks >= stop_after and not finished:
            return "cancelled", ""  # leaving the `async with` closes the connection before the end
    if done and finished:
        return "ok", ""
    return "errored", f"stream ended without {'[DONE]' if not done else 'a finish reason'}"


def completion_body(rng: random.Random, target: Target, **extra: Any) -> dict[str, Any]:
    return {"model": target.model, "prompt": prompt(rng, target), "max_tokens": rng.randint(1, target.max_tokens),
            "temperature": rng.choice([0.0, 0.7, 1.0]), **extra}


def chat_body(rng: random.Random, target: Target, **extra: Any) -> dict[str, Any]:
    return {"model": target.model, "messages": messages(rng, target), "max_tokens": rng.randint(1, target.max_tokens),
            "temperature": rng.choice([0.0, 0.8]), **extra}


Scenario = Callable[[httpx.AsyncClient, random.Random, Target], Awaitable[tuple[str, str]]]


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[str, str]:
    response = await client.post(path, json=body)
    return by_status(response.status_code, response.content)


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                  stop_after: int | None = None) -> tuple[str, str]:
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        return await read_stream(response, stop_after)


async def completion(client: httpx.AsyncClient, rng: random.Random, target: Target) -> tuple[str, str]:
    return await _post(client, "/v1/completions", completion_body(rng, target, n=rng.choice([1, 1, 2, 3])))


async def completion_stream(client: httpx.AsyncClient, rng: random.Random, target: Target) -> tuple[str, str]:
    return await _stream(client, "/v1/completions", completion_body(rng, target, n=rng.choice([1, 1, 2])))


async def chat(client: httpx.AsyncClient, rng: random.Random, target: Target) -> tuple[str, str]:
    return await _post(client, "/v1/chat/completions", chat_body(rng, target, n=rng.choice([1, 1, 2])))


async def chat_stream(client: httpx.AsyncClient, rng: random.Random, target: Target) -> tuple[str, str]:
    return await _stream(client, "/v1/chat/completions", chat_body(rng, target, n=rng.choice([1, 2])))


async def disconnect_mid_stream(client: httpx.AsyncClient, rng: random.Random, target: Target) -> tuple[str, str]:
    """A long stream the client closes after a few chunks: the server must abort it and free its blocks."""
    path, body = rng.choice([("/v1/completions", completion_body(rng, target)),
                             ("/v1/chat/completions", chat_body(rng, target))])
    body.update(max_tokens=4 * target.max_tokens, ignore_eos=True)
    return await _stream(client, path, body, stop_after=rng.randint(1, 4))


async def abandon_before_answer(client: httpx.AsyncClient, rng: random.Random, target: Target) -> tuple[str, str]:
    """A non-streamed request the client stops waiting for (a client-side timeout)."""
    body = completion_body(rng, target, max_tokens=4 * target.max_tokens, ignore_eos=True)
    try:
        return await asyncio.wait_for(_post(client, "/v1/completions", body), timeout=rng.uniform(0.02, 0.3))
    except TimeoutError:
        return "cancelled", ""


def _bad_bodies(target: Target) -> list[tuple[str, Any]]:
    """Inputs every OpenAI-compatible server must refuse with a 4xx (path, JSON body or raw bytes)."""
    hi = {"model": target.model, "prompt": "hi"}
    chat_hi = {"model": target.model, "messages": [{"role": "user", "content": "hi"}]}
    return [
        ("/v1/completions", {**hi, "max_tokens": -1}),
        ("/v1/completions", {**hi, "temperature": "hot"}),
        ("/v1/completions", {**hi, "n": 10_000}),
        ("/v1/completions", {**hi, "prompt": "word " * 5000}),
        ("/v1/completions", {"model": target.model}),
        ("/v1/completions", b'{"prompt": "unterminated'),
        ("/v1/chat/completions", {**chat_hi, "messages": "not a list"}),
        ("/v1/chat/completions", {**chat_hi, "model": "no-such-model"}),
        ("/v1/chat/completions", {**chat_hi, "top_p": 7}),
        ("/v1/no-such-route", chat_hi),
    ]


async def bad_input(client: httpx.AsyncClient, rng: random.Random, target: Target) -> tuple[str, str]:
    path, body = rng.choice(_bad_bodies(target))
    if isinstance(body, bytes):
        response = await client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = await client.post(path, json=body)
    return by_status(response.status_code, response.content, bad_input=True)


async def burst_member(client: httpx.AsyncClient, rng: random.Random, target: Target) -> tuple[str, str]:
    """One of many sent at once, past the admission bound: a 429 is the right answer for the ones beyond it."""
    return await _post(client, "/v1/completions", completion_body(rng, target, max_tokens=rng.randint(1, 8)))


MIX: dict[str, tuple[Scenario, float]] = {
    "completion": (completion, 3), "completion_stream": (completion_stream, 3), "chat": (chat, 3),
    "chat_stream": (chat_stream, 3), "disconnect_mid_stream": (disconnect_mid_stream, 2),
    "abandon_before_answer": (abandon_before_answer, 1), "bad_input": (bad_input, 2),
}


async def send(kind: str, scenario: Scenario, client: httpx.AsyncClient, rng: random.Random, target: Target,
               ledger: Ledger, timeout: float) -> None:
    """One request with its ledger entry: counted as sent first, then exactly one outcome or none (lost)."""
    ledger.sent += 1
    try:
        outcome, detail = await asyncio.wait_for(scenario(client, rng, target), timeout)
    except TimeoutError:
        ledger.timed_out += 1  # no answer in time: lost, the one failure the ledger cannot excuse
        return
    except (httpx.HTTPError, ValueError) as exc:  # a broken connection or an unparsable chunk
        outcome, detail = "errored", f"{type(exc).__name__}: {exc}"
    ledger.record(kind, outcome, detail)


async def worker(client: httpx.AsyncClient, rng: random.Random, target: Target, ledger: Ledger, until: float,
                 timeout: float) -> None:
    """Sends one request after another from the mix until the loop's clock passes `until`."""
    loop = asyncio.get_running_loop()
    kinds = list(MIX)
    weights = [MIX[k][1] for k in kinds]
    while loop.time() < until:
        kind = rng.choices(kinds, weights)[0]
        await send(kind, MIX[kind][0], client, rng, target, ledger, timeout)
        await asyncio.sleep(rng.uniform(0, 0.05))


async def bursts(client: httpx.AsyncClient, rng: random.Random, target: Target, ledger: Ledger, until: float,
                 timeout: float, size: int, interval: float) -> None:
    """Every `interval` seconds, `size` requests at once."""
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        await asyncio.gather(*(send("burst", burst_member, client, rng, target, ledger, timeout)
                               for _ in range(size)))
        await asyncio.sleep(min(interval, max(0.0, until - loop.time())))
