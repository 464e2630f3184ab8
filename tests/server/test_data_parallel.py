"""Data parallelism behind the real servers: two engine replicas of the tiny chat model on two CPU devices.

`local` is what `jengine serve --data-parallel-size 2` runs (the router over in-process replicas); `remote` is what
`jengine openai --engine A --engine B` runs (the router over gRPC clients of each replica's gRPC service). Requests
that share a system prompt reach one replica only (its prefix-cache counters move, the other's do not), distinct
ones reach both, chats that share only the template's header spread over both, the answers are the engine's own,
/metrics labels each replica's series `engine="0"`/`"1"`, and nothing is left on either replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaConfig

from jengine.cli import build_parser, main
from jengine.config import EngineConfig
from jengine.clients.async_engine import AsyncEngine
from jengine.clients.router import Router
from jengine.sampling.params import SamplingParams
from server.grpc_client import GrpcEngineClient
from server.grpc_service import start_grpc_server
from tests.conftest import COMMON
from tests.server.conftest import (ENGINE_KWARGS, MODEL_NAME, Samples, Servers, ServerHandle, metric, scrape,
                                   wait_for)
from tests.server.grpc_fixtures import LoopThread

SYSTEM = ("You are a careful assistant. Answer in one short sentence, in English, and never mention the weather. "
          "The quick brown fox jumps over the lazy dog; the engine streams each piece of text as it arrives.")
QUESTIONS = ["Hello, how are you?", "What is a tokenizer?", "Why is the sun shining?", "Count to three."]
MAX_TOKENS = 6
BLOCK = 16  # the KV block size (the default)
SHORT_SYSTEM = "Answer in one short line."  # with the template's header: two full KV blocks every chat shares
RULES = 44  # sentences of the long system prompt: over 1,024 tokens
DP_MAX_MODEL_LEN = 1280  # fits the long system prompt and a question


@dataclasses.dataclass
class DataParallel:
    local: ServerHandle
    remote: ServerHandle
    replicas: list[AsyncEngine]

    def front(self, name: str) -> ServerHandle:
        return self.local if name == "local" else self.remote


@pytest.fixture(scope="module")
def dp(build_checkpoint: Callable, chat_tokenizer_dir: Path) -> Iterator[DataParallel]:
    """The tiny chat model with room for a long system prompt, two replicas behind both fronts."""
    long_model_dir = build_checkpoint(LlamaConfig(**{**COMMON, "max_position_embeddings": DP_MAX_MODEL_LEN}),
                                      tokenizer_dir=chat_tokenizer_dir)[0]
    config = EngineConfig.from_kwargs(str(long_model_dir), served_model_name=MODEL_NAME, data_parallel_size=2,
                                      compile_buckets="all",  # no lazy compile stalling one replica mid-test
                                      max_num_batched_tokens=512,  # fewer step shapes to compile
                                      **{**ENGINE_KWARGS, "max_model_len": DP_MAX_MODEL_LEN})
    router = Router.from_config(config)
    replicas: list[AsyncEngine] = router.replicas  # type: ignore[assignment]
    local_servers, remote_servers, loops = Servers(), Servers(), LoopThread()
    grpc_servers = [loops.run(start_grpc_server(engine, "127.0.0.1", 0)) for engine in replicas]
    try:
        local = local_servers.serve(router)
        remote = remote_servers.serve(Router([GrpcEngineClient(f"127.0.0.1:{s.port}") for s in grpc_servers]))
        yield DataParallel(local, remote, replicas)
    finally:
        remote_servers.stop_all()  # closes the gRPC clients only
        for grpc_server in grpc_servers:
            loops.run(grpc_server.stop(None))
        loops.close()
        local_servers.stop_all()  # shuts the replicas down


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _engine_answers(engine: AsyncEngine, prompts: Sequence[Any]) -> list[str]:
    """The replica's own greedy answers, asked directly (the reference for what the servers return)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    async def run() -> list[str]:
        answers = []
        for prompt in prompts:
            answers.append("".join([o.outputs[0].text async for o in engine.generate(prompt, params)]))
        return answers

    return asyncio.run(run())


async def _chats(handle: ServerHandle, questions: Sequence[str]) -> list[str]:
    async with handle.async_client() as client:
        replies = await asyncio.gather(*(
            client.chat.completions.create(model=MODEL_NAME, messages=_messages(q), temperature=0,
                                           max_tokens=MAX_TOKENS) for q in questions))
    return [reply.choices[0].message.content for reply in replies]


async def _completions(handle: ServerHandle, prompts: Sequence[str]) -> list[str]:
    async with handle.async_client() as client:
        replies = await asyncio.gather(*(
            client.completions.create(model=MODEL_NAME, prompt=p, temperature=0, max_tokens=MAX_TOKENS)
            for p in prompts))
    return [reply.choices[0].text for reply in replies]


def _queries(dp: DataParallel) -> list[int]:
    return [engine.stats().prefix_cache_queries for engine in dp.replicas]


def _wait_idle(dp: DataParallel, handle: ServerHandle) -> None:
    def idle(engine: AsyncEngine) -> bool:
        s = engine.stats()
        return (s.num_running, s.num_waiting, s.kv_cache_usage, engine.num_in_flight, engine.num_streams) == (
            0, 0, 0.0, 0, 0)

    wait_for(lambda: all(idle(e) for e in dp.replicas) and handle.state.in_flight == 0, what="both replicas idle")


@pytest.mark.parametrize("front", ["local", "remote"])
def test_shared_system_prompt_sticks_and_other_prompts_spread(dp: DataParallel, front: str) -> None:
    handle = dp.front(front)
    chats = [{"messages": _messages(q)} for q in QUESTIONS]
    prompts = [f"Item {i}: {q}" for i, q in enumerate(QUESTIONS * 2)]
    expected_chats = _engine_answers(dp.replicas[0], chats)
    expected_completions = _engine_answers(dp.replicas[1], prompts)

    before = _queries(dp)
    answers = asyncio.run(_chats(handle, QUESTIONS[:1]))  # the first computes (and caches) the system prompt
    answers += asyncio.run(_chats(handle, QUESTIONS[1:]))
    moved = [after - b for after, b in zip(_queries(dp), before)]
    assert sorted(delta > 0 for delta in moved) == [False, True], moved  # one replica saw every shared request
    assert answers == expected_chats

    before = _queries(dp)
    assert asyncio.run(_completions(handle, prompts)) == expected_completions
    assert all(after > b for after, b in zip(_queries(dp), before))  # distinct prompts reached both replicas
    _wait_idle(dp, handle)


@pytest.mark.parametrize("front", ["local", "remote"])
def test_metrics_label_each_replica(dp: DataParallel, front: str) -> None:
    handle = dp.front(front)
    assert handle.client().models.list().data[0].id == MODEL_NAME
    assert handle.http.get("/health").status_code == 200
    stats = [engine.stats() for engine in dp.replicas]

    def labelled() -> bool:
        samples = scrape(handle)
        return all(
            metric(samples, "jengine:prefix_cache_queries_total", engine=str(i)) == s.prefix_cache_queries
            and metric(samples, "jengine:cache_config_info", block_size="16", num_gpu_blocks=str(s.num_gpu_blocks),
                       engine=str(i)) == 1.0
            for i, s in enumerate(stats))

    wait_for(labelled, what="/metrics labelling each replica")
    samples = scrape(handle)
    engines = {dict(labels).get("engine") for name, labels in samples
               if name.startswith("jengine:") and not name.startswith("jengine:admission_rejections")}
    assert engines == {"0", "1"}  # every engine-level series is labelled: no unlabelled sum beside them


def _served(samples: Samples, name: str) -> list[float]:
    """A series per engine, summed over its other labels (finish reasons)."""
    return [sum(value for (key, labels), value in samples.items() if key == name and ("engine", str(e)) in labels)
            for e in range(2)]


async def _chat_all(handle: ServerHandle, conversations: Sequence[list[dict[str, str]]], in_flight: int) -> None:
    """Every chat, `in_flight` at a time, one token each."""
    gate = asyncio.Semaphore(in_flight)
    async with handle.async_client() as client:
        async def one(messages: list[dict[str, str]]) -> None:
            async with gate:
                await client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                                     max_tokens=1)

        await asyncio.gather(*(one(messages) for messages in conversations))


def _chat(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _shared_tokens(dp: DataParallel, first: list[dict[str, str]], second: list[dict[str, str]]) -> int:
    tokenizer = dp.replicas[0].get_tokenizer()
    a, b = (tokenizer.encode(tokenizer.apply_chat_template(m, add_generation_prompt=True)) for m in (first, second))
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def test_chats_sharing_only_the_template_header_spread_over_both_replicas(dp: DataParallel) -> None:
    handle = dp.local
    chats = [_chat(SHORT_SYSTEM, f"{i}: what is a cat?") for i in range(200)]
    assert 2 * BLOCK <= _shared_tokens(dp, chats[1], chats[23]) < 3 * BLOCK  # ~40 tokens, two full blocks
    before = scrape(handle)
    asyncio.run(_chat_all(handle, chats, in_flight=16))
    _wait_idle(dp, handle)
    after = scrape(handle)
    served = [a - b for a, b in zip(_served(after, "jengine:request_success_total"),
                                    _served(before, "jengine:request_success_total"))]
    assert sum(served) == len(chats) and min(served) >= 0.35 * len(chats), served


def test_long_system_prompts_stay_where_they_are_cached(dp: DataParallel) -> None:
    handle = dp.local
    rules = " ".join(f"Rule {k}: answer politely." for k in range(RULES))
    systems = [f"{name} {rules}" for name in ("First.", "Second.")]  # different from their first block on
    chats = [[_chat(system, f"{i}: why?") for i in range(3)] for system in systems]
    cached = _shared_tokens(dp, chats[0][0], chats[0][1]) // BLOCK * BLOCK
    assert cached >= 1024
    handle.engine.refresh()
    before = scrape(handle)
    for first in (chats[0][0], chats[1][0]):  # each computed (and cached) once, on the replica chosen for it
        asyncio.run(_chat_all(handle, [first], in_flight=1))
    asyncio.run(_chat_all(handle, chats[0][1:] + chats[1][1:], in_flight=4))  # loads within the bound
    _wait_idle(dp, handle)
    handle.engine.refresh()  # the router's snapshots of the replicas' stats, which /metrics reads, made current
    after = scrape(handle)

    def delta(name: str) -> list[float]:
        return [a - b for a, b in zip(_served(after, name), _served(before, name))]

    assert delta("jengine:request_success_total") == [3, 3]  # one system prompt per replica
    hits = delta("jengine:prefix_cache_hits_total")
    assert min(hits) >= 2 * cached and sum(hits) < 5 * cached, hits  # every later request hit its prompt's cache


def test_cli_data_parallel_flags(chat_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(chat_model_dir), "--data-parallel-size", "9"]) == 1
    assert "needs 9 devices, but only 8" in capsys.readouterr().err  # refused before any weight is loaded
    assert main(["serve", str(chat_model_dir), "--tensor-parallel-size", "3", "--data-parallel-size", "3"]) == 1
    assert "needs 9 devices" in capsys.readouterr().err
    assert build_parser().parse_args(["openai", "--engine", "a:1", "--engine", "b:2"]).engine == ["a:1", "b:2"]
    assert main(["openai", "--engine", "a:1", "--engine", "a:1"]) == 1
    assert "once" in capsys.readouterr().err
    assert main(["openai", "--engine", "a:1", "--engine", "b"]) == 1
    assert "HOST:PORT" in capsys.readouterr().err

