"""The data-parallel router: prefix-aware routing over engine replicas.

Routing rules on replicas without a model (AsyncEngines over fake cores, held in flight by pausing them), then two
real replicas of a tiny model on two of the simulated CPU devices, compared with a single engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import pytest
from transformers import LlamaConfig

from jengine.config import EngineConfig
from jengine.clients.async_engine import AsyncEngine
from jengine.clients.protocol import EngineClient
from jengine.engine.stats import EngineStats
from jengine.cache.prefix_index import PrefixIndex
from jengine.clients.router import Router
from jengine.errors import CapacityError, ConfigError, EngineDeadError, InvalidRequestError
from jengine.outputs import RequestOutput
from jengine.request import RequestStatus
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import CHATML_TEMPLATE, Tokenizer, train_tiny_tokenizer

from tests.conftest import COMMON, TOKENIZER_VOCAB
from tests.engine.conftest import FakeCore, make_parts

BLOCK = 16
SHORT = SamplingParams(max_tokens=2, ignore_eos=True)
NEVER = 3600.0  # poll interval for the fake tests: health and stats change only when a test calls refresh()


def shared_prefix_prompt(i: int, blocks: int = 5) -> list[int]:
    """`blocks` full blocks every such prompt shares, then a suffix of its own."""
    return [10 + k % 50 for k in range(blocks * BLOCK)] + [100 + i, 101 + i, 102 + i]


def distinct_prompt(i: int) -> list[int]:
    """Three full blocks whose first block no other prompt of the tests has."""
    return [60 + i] + [70 + (i + k) % 20 for k in range(3 * BLOCK)]


async def _drain(stream: Any) -> list[RequestOutput]:
    return [out async for out in stream]


def submit(router: Router, prompt: Any, request_id: str, params: SamplingParams = SHORT
           ) -> tuple[asyncio.Task[list[RequestOutput]], int | None]:
    """Start a request eagerly: routing and admission happen before this returns. Returns (task, its replica)."""
    task = asyncio.Task(_drain(router.generate(prompt, params, request_id)), loop=asyncio.get_running_loop(),
                        eager_start=True)
    return task, router.owner(request_id)


@dataclasses.dataclass
class Reporting:
    """A replica whose published stats say what a test wants (e.g. requests sent by another front)."""

    engine: AsyncEngine
    reported: EngineStats

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def stats(self) -> EngineStats:
        return self.reported


@dataclasses.dataclass
class Fleet:
    router: Router
    engines: list[AsyncEngine]
    cores: list[FakeCore]

    def pause(self) -> None:
        for core in self.cores:
            core.paused.set()

    def release(self) -> None:
        for core in self.cores:
            core.paused.clear()


@pytest.fixture
def make_fleet(tokenizer: Tokenizer) -> Iterator[Callable[..., Fleet]]:
    routers: list[Router] = []

    def make(n: int = 2, *, wrap: Callable[[int, AsyncEngine], EngineClient] | None = None,
             block_size: int | None = BLOCK, **limits: Any) -> Fleet:
        parts = [make_parts(tokenizer, **limits) for _ in range(n)]
        engines = [AsyncEngine(p) for p in parts]  # type: ignore[arg-type]
        clients = [wrap(i, e) if wrap else e for i, e in enumerate(engines)]
        routers.append(Router(clients, block_size=block_size, poll_interval_s=NEVER))
        return Fleet(routers[-1], engines, [p.core for p in parts])

    yield make
    for router in routers:
        router.shutdown()


# ------------------------------------------------------------------------------------------- routing rules (fakes)

def test_shared_prefix_sticks_and_other_load_spreads(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet()
    fleet.pause()

    async def run() -> None:
        shared = [submit(fleet.router, shared_prefix_prompt(i), f"s{i}") for i in range(4)]
        # the sticky replica is busier than the other, yet the shared prefix still goes there
        assert len({owner for _, owner in shared}) == 1 and shared[0][1] is not None
        sticky = shared[0][1]
        others = [submit(fleet.router, distinct_prompt(i), f"d{i}") for i in range(8)]
        assert [owner for _, owner in others[:4]] == [1 - sticky] * 4  # the idle replica first
        loads = [sum(owner == r for _, owner in shared + others) for r in (0, 1)]
        assert loads == [6, 6]
        fleet.release()
        results = await asyncio.gather(*(task for task, _ in shared + others))
        assert all(outputs[-1].finished for outputs in results)
        for (_, owner), rid in zip(shared + others, [f"s{i}" for i in range(4)] + [f"d{i}" for i in range(8)]):
            assert rid in fleet.cores[owner].added and rid not in fleet.cores[1 - owner].added

    asyncio.run(run())
    assert all(e.num_in_flight == 0 and e.num_streams == 0 for e in fleet.engines)


def test_distinct_prompts_spread_evenly_and_arrive_unchanged(make_fleet: Callable[..., Fleet],
                                                             tokenizer: Tokenizer) -> None:
    fleet = make_fleet(3)
    fleet.pause()
    text = "Hello, world! How are you today?"

    async def run() -> list[list[RequestOutput]]:
        started = [submit(fleet.router, distinct_prompt(i), f"d{i}") for i in range(5)]
        started.append(submit(fleet.router, text, "t"))
        assert sorted(owner for _, owner in started) == [0, 0, 1, 1, 2, 2]
        fleet.release()
        return await asyncio.gather(*(task for task, _ in started))

    results = asyncio.run(run())
    for i, outputs in enumerate(results[:5]):  # token-id prompts: no text, the ids as given
        assert outputs[0].prompt is None and outputs[0].prompt_token_ids == distinct_prompt(i)
    assert results[5][0].prompt == text and results[5][0].prompt_token_ids == tokenizer.encode(text)


def test_sequential_requests_alternate_when_idle(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet()

    async def run() -> list[int | None]:
        owners = []
        for i in range(4):
            task, owner = submit(fleet.router, distinct_prompt(i), f"q{i}")
            owners.append(owner)
            await task
        return owners

    assert asyncio.run(run()) == [0, 1, 0, 1]


def test_load_includes_requests_from_other_fronts(make_fleet: Callable[..., Fleet]) -> None:
    busy = EngineStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_gpu_blocks=100, block_size=BLOCK)
    idle = EngineStats(num_gpu_blocks=300, block_size=BLOCK)
    fleet = make_fleet(wrap=lambda i, e: Reporting(e, busy if i == 0 else idle), block_size=None)
    assert fleet.router.block_size == BLOCK  # taken from the replicas
    fleet.pause()

    async def run() -> list[int | None]:
        started = [submit(fleet.router, distinct_prompt(i), f"d{i}") for i in range(5)]
        fleet.release()
        await asyncio.gather(*(task for task, _ in started))
        return [owner for _, owner in started]

    assert asyncio.run(run()) == [1, 1, 1, 0, 1]  # replica 0's 3 count until the other holds as many
    total = fleet.router.stats()
    assert (total.num_running, total.num_waiting, total.num_gpu_blocks) == (2, 1, 400)
    assert total.kv_cache_usage == pytest.approx(0.5 * 100 / 400)
    assert fleet.router.replica_stats() == [busy, idle]


def test_unhealthy_replicas_are_skipped(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet()
    router = fleet.router

    async def run() -> None:
        task, first = submit(router, shared_prefix_prompt(0), "a")
        await task
        fleet.engines[first].shutdown()  # dead, and the router has not polled since
        task, owner = submit(router, shared_prefix_prompt(1), "b")  # its prefix is on the dead one
        assert owner == 1 - first and len(await task) > 0
        assert router.is_healthy()
        fleet.engines[1 - first].shutdown()
        router.refresh()
        assert not router.is_healthy()
        with pytest.raises(EngineDeadError):
            await _drain(router.generate(distinct_prompt(0), SHORT))

    asyncio.run(run())


def test_a_full_replica_hands_over_to_the_next(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(max_num_seqs=1, max_num_queued_reqs=1)  # each replica holds 2 requests
    fleet.pause()

    async def run() -> None:
        started = [submit(fleet.router, shared_prefix_prompt(i), f"s{i}") for i in range(4)]
        sticky = started[0][1]
        assert [owner for _, owner in started] == [sticky, sticky, 1 - sticky, 1 - sticky]
        with pytest.raises(CapacityError):
            await _drain(fleet.router.generate(shared_prefix_prompt(9), SHORT, "full"))
        assert fleet.router.owner("full") is None
        fleet.release()
        await asyncio.gather(*(task for task, _ in started))

    asyncio.run(run())
    assert all(e.num_in_flight == 0 for e in fleet.engines)


def test_abort_goes_to_the_replica_holding_the_request(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet()
    fleet.pause()

    async def run() -> None:
        (task_a, owner_a), (task_b, owner_b) = (submit(fleet.router, distinct_prompt(i), f"r{i}") for i in range(2))
        assert {owner_a, owner_b} == {0, 1}
        await fleet.router.abort("unknown")  # ignored
        await fleet.router.abort("r1")
        fleet.release()
        outputs_b = await task_b
        assert outputs_b[-1].outputs[0].finish_reason == "abort"
        assert fleet.cores[owner_b].aborted == [("r1", RequestStatus.FINISHED_ABORTED)]
        assert (await task_a)[-1].outputs[0].finish_reason == "length" and fleet.cores[owner_a].aborted == []

    asyncio.run(run())


def test_a_consumer_that_leaves_aborts_on_the_replica(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet()
    fleet.pause()

    async def run() -> None:
        task, owner = submit(fleet.router, distinct_prompt(0), "gone")
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert fleet.router.owner("gone") is None
        fleet.release()
        deadline = time.monotonic() + 5
        while fleet.engines[owner].num_in_flight:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        assert fleet.cores[owner].aborted == [("gone", RequestStatus.FINISHED_ABORTED)]

    asyncio.run(run())


def test_request_ids_are_unique_across_replicas(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet()
    fleet.pause()

    async def run() -> None:
        task, _ = submit(fleet.router, distinct_prompt(0), "same")
        with pytest.raises(InvalidRequestError, match="already in use"):
            await _drain(fleet.router.generate(distinct_prompt(1), SHORT, "same"))
        fleet.release()
        await task

    asyncio.run(run())


def test_an_engine_client_that_polls_and_owns_its_replicas(tokenizer: Tokenizer) -> None:
    engines = [AsyncEngine(make_parts(tokenizer)) for _ in range(2)]  # type: ignore[arg-type]
    router = Router(engines, block_size=BLOCK, poll_interval_s=0.01)
    try:
        assert isinstance(router, EngineClient) and router.get_model_info() == engines[0].get_model_info()
        engines[0].shutdown()
        time.sleep(0.05)
        assert router.is_healthy()  # one replica left
        engines[1].shutdown()
        deadline = time.monotonic() + 5
        while router.is_healthy():  # noticed by the poller, nobody calls refresh()
            assert time.monotonic() < deadline, "the poller did not notice the dead replicas"
            time.sleep(0.01)
    finally:
        router.shutdown()


def test_shutting_the_router_down_shuts_its_replicas_down(make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet()
    fleet.router.shutdown()
    assert not any(engine.is_healthy() for engine in fleet.engines)


def test_replicas_must_serve_the_same_model(tokenizer: Tokenizer) -> None:
    engines = [AsyncEngine(make_parts(tokenizer, max_model_len=length)) for length in (128, 64)]  # type: ignore
    try:
        with pytest.raises(ConfigError, match="different models"):
            Router(engines, block_size=BLOCK)
        with pytest.raises(ConfigError, match="do not report their KV block size"):
            Router(engines[:1])
        stats = [EngineStats(block_size=16), EngineStats(block_size=32)]
        with pytest.raises(ConfigError, match="different KV block sizes"):
            Router([Reporting(engines[0], s) for s in stats])
        with pytest.raises(ConfigError, match="at least one"):
            Router([])
    finally:
        for engine in engines:
            engine.shutdown()


def test_prefix_index_is_bounded_and_evicts_tails_first() -> None:
    index = PrefixIndex(capacity=4)
    first, second = [b"a0", b"a1", b"a2", b"a3"], [b"b0", b"b1"]
    index.remember(first)
    assert index.match(first) == 4 and index.match([b"a0", b"x", b"a2"]) == 1 and index.match([b"a1"]) == 1
    index.remember(second)
    assert len(index) == 4 and index.match(second) == 2
    assert index.match(first) == 2  # the older prompt lost its tail, its head still matches
    with pytest.raises(ConfigError):
        PrefixIndex(0)


# ------------------------------------------------------------------------------------------- two real replicas

MAX_MODEL_LEN = 256
ENGINE_KWARGS = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_queued_reqs=24,
                     block_size=BLOCK)
SYSTEM = ("You are a careful assistant. Answer in one short sentence, in English, and never mention the weather. "
          "The quick brown fox jumps over the lazy dog; the engine streams each piece of text as it arrives.")
QUESTIONS = ["Hello, how are you?", "What is a tokenizer?", "你好，世界。", "Why is the sun shining?", "Count to three."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@dataclasses.dataclass
class Replicated:
    router: Router
    single: AsyncEngine  # the reference: one engine alone
    tokenizer: Tokenizer


@pytest.fixture(scope="module")
def replicated(build_checkpoint: Callable, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicated]:
    tokenizer_dir = train_tiny_tokenizer(tmp_path_factory.mktemp("router_tokenizer"), vocab_size=TOKENIZER_VOCAB,
                                         chat_template=CHATML_TEMPLATE)
    model_dir: Path = build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=tokenizer_dir)[0]
    router = Router.from_config(EngineConfig.from_kwargs(str(model_dir), data_parallel_size=2, **ENGINE_KWARGS))
    single = AsyncEngine.from_config(EngineConfig.from_kwargs(str(model_dir), **ENGINE_KWARGS))
    yield Replicated(router, single, single.get_tokenizer())
    router.shutdown()
    single.shutdown()


def _chat(question: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}


def _tokens(outputs: Sequence[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.outputs[0].token_ids]


def _reference(engine: AsyncEngine, prompts: Sequence[Any]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        return [_tokens(await _drain(engine.generate(p, GREEDY))) for p in prompts]

    return asyncio.run(run())


def _wait_idle(engines: Sequence[EngineClient], timeout: float = 5.0) -> None:
    """Nothing lost on any replica: no request running, queued or admitted, every KV block's ref count back to 0."""
    def idle(e: Any) -> bool:
        s = e.stats()
        return (s.num_running, s.num_waiting, s.kv_cache_usage, e.num_in_flight, e.num_streams) == (0, 0, 0.0, 0, 0)

    deadline = time.monotonic() + timeout
    while not all(idle(e) for e in engines):
        assert time.monotonic() < deadline, [e.stats() for e in engines]
        time.sleep(0.01)


def test_replicas_sit_on_disjoint_devices(replicated: Replicated) -> None:
    placed = [{d for leaf in jax.tree.leaves(e._parts.core.runner.params) for d in leaf.devices()}
              for e in replicated.router.replicas]
    assert placed == [{jax.devices()[0]}, {jax.devices()[1]}]


def test_shared_system_prompt_sticks_to_one_replica_and_hits_its_cache(replicated: Replicated) -> None:
    router, prompts = replicated.router, [_chat(q) for q in QUESTIONS]
    system_blocks = len(replicated.tokenizer.encode(SYSTEM)) // BLOCK
    assert system_blocks >= 3  # the shared part spans several blocks
    before = [e.stats().prefix_cache_hits for e in router.replicas]

    async def run() -> tuple[list[int | None], list[list[RequestOutput]]]:
        first_task, first_owner = submit(router, prompts[0], "sys-0", GREEDY)
        first = await first_task  # computed (and cached) before the others arrive
        rest = [submit(router, p, f"sys-{i}", GREEDY) for i, p in enumerate(prompts[1:], start=1)]
        return [first_owner] + [owner for _, owner in rest], [first] + list(
            await asyncio.gather(*(task for task, _ in rest)))

    owners, results = asyncio.run(run())
    assert len(set(owners)) == 1 and owners[0] is not None
    sticky = owners[0]
    assert all(outputs[0].num_cached_tokens >= system_blocks * BLOCK for outputs in results[1:])
    after = [e.stats().prefix_cache_hits for e in router.replicas]
    assert after[sticky] - before[sticky] >= (len(prompts) - 1) * system_blocks * BLOCK
    assert after[1 - sticky] == before[1 - sticky]
    assert [_tokens(outputs) for outputs in results] == _reference(replicated.single, prompts)
    assert results[0][0].prompt == replicated.tokenizer.apply_chat_template(prompts[0]["messages"])
    _wait_idle(router.replicas)
    # the router names blocks as the KV managers do: what it remembers sending is what the replica has cached
    for engine, index in zip(router.replicas, router.prefix_indexes):
        pool = engine._parts.core.kv_manager.block_pool
        assert all(pool.lookup(block_hash) is not None for block_hash in index)
    assert len(router.prefix_indexes[sticky]) >= system_blocks


def test_distinct_prompts_spread_over_both_replicas(replicated: Replicated) -> None:
    router = replicated.router
    prompts = [f"Item {i}: {q} Tell me more." for i, q in enumerate(QUESTIONS * 2)]  # no two share a first block

    async def run() -> tuple[list[int | None], list[list[RequestOutput]]]:
        started = [submit(router, p, f"spread-{i}", GREEDY) for i, p in enumerate(prompts)]
        return [owner for _, owner in started], list(await asyncio.gather(*(task for task, _ in started)))

    owners, results = asyncio.run(run())
    assert sorted(owners) == [0] * 5 + [1] * 5
    assert [_tokens(outputs) for outputs in results] == _reference(replicated.single, prompts)
    assert all(outputs[-1].finished for outputs in results)
    _wait_idle(router.replicas)
    assert router.stats().num_gpu_blocks == sum(e.stats().num_gpu_blocks for e in router.replicas)
