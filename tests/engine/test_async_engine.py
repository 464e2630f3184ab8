"""AsyncEngine over a fake core: streaming, admission bound, aborts on cancel, engine death, the idle loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from jengine.clients.async_engine import AsyncEngine
from jengine.clients.protocol import EngineClient
from jengine.errors import CapacityError, EngineDeadError, InvalidRequestError
from jengine.outputs import RequestOutput
from jengine.request import RequestStatus
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import Tokenizer

from tests.engine.conftest import FakeCore, make_parts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


@pytest.fixture
def make_engine(tokenizer: Tokenizer) -> Iterator[Callable[..., tuple[AsyncEngine, FakeCore]]]:
    engines: list[AsyncEngine] = []

    def make(core: FakeCore | None = None, **limits: int) -> tuple[AsyncEngine, FakeCore]:
        parts = make_parts(tokenizer, core, **limits)
        engines.append(AsyncEngine(parts))  # type: ignore[arg-type]
        return engines[-1], parts.core

    yield make
    for engine in engines:
        engine.shutdown()


async def _collect(engine: AsyncEngine, prompt: object, params: SamplingParams = GREEDY,
                   request_id: str | None = None) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, request_id)]  # type: ignore[arg-type]


async def _wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_is_an_engine_client(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]]) -> None:
    engine, _ = make_engine()
    assert isinstance(engine, EngineClient)
    info = engine.get_model_info()
    assert (info.name, info.max_model_len) == ("fake-model", 128)


def test_streams_deltas_then_a_finished_output(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]],
                                               tokenizer: Tokenizer) -> None:
    engine, core = make_engine()
    outputs = asyncio.run(_collect(engine, "Hello, world!", request_id="a"))
    assert [o.finished for o in outputs][-1] and not any(o.finished for o in outputs[:-1])
    token_ids = [t for o in outputs for t in o.outputs[0].token_ids]
    prompt = tokenizer.encode("Hello, world!")
    assert token_ids == [prompt[k % len(prompt)] for k in range(8)]
    assert "".join(o.outputs[0].text for o in outputs) == tokenizer.decode(token_ids)
    assert outputs[-1].outputs[0].finish_reason == "length" and outputs[-1].request_id == "a"
    assert core.num_requests() == 0 and engine.num_in_flight == 0 and engine.num_streams == 0


def test_n_choices_stream_by_index(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]]) -> None:
    engine, core = make_engine()
    outputs = asyncio.run(_collect(engine, "Hello", SamplingParams(n=3, max_tokens=4, ignore_eos=True)))
    per_choice: dict[int, list[int]] = {}
    for out in outputs:
        for choice in out.outputs:
            per_choice.setdefault(choice.index, []).extend(choice.token_ids)
    assert sorted(per_choice) == [0, 1, 2] and all(len(t) == 4 for t in per_choice.values())
    assert len({tuple(t) for t in per_choice.values()}) == 3
    assert sorted(core.added) == sorted(f"{outputs[0].request_id}-{i}" for i in range(3))


def test_stop_string_stops_the_core_request(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]]) -> None:
    engine, core = make_engine(FakeCore(step_delay=0.002))
    params = SamplingParams(max_tokens=100, ignore_eos=True, stop="world")

    async def run() -> list[RequestOutput]:
        outputs = await _collect(engine, "Hello, world! How are you?", params, "s")
        await _wait_for(lambda: engine.num_in_flight == 0)  # the slot frees once the core confirms the stop
        return outputs

    outputs = asyncio.run(run())
    final = outputs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", "world")
    assert "".join(o.outputs[0].text for o in outputs) == "Hello, "  # the script replays the prompt (after BOS)
    assert core.aborted == [("s", RequestStatus.FINISHED_STOPPED)] and core.num_requests() == 0


def test_admission_bound_is_exact(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]]) -> None:
    engine, core = make_engine(max_num_seqs=2, max_num_queued_reqs=3)
    bound = 5
    core.paused.set()

    async def burst() -> None:
        gens = [engine.generate("Hello", GREEDY) for _ in range(bound + 1)]
        firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await asyncio.sleep(0.01)
        assert isinstance(firsts[-1].exception(), CapacityError)  # refused at once, before any progress
        assert not any(f.done() for f in firsts[:-1])
        assert engine.num_in_flight == bound
        core.paused.clear()
        await asyncio.gather(*firsts[:-1])
        for gen in gens[:-1]:
            async for _ in gen:
                pass
        assert len(await _collect(engine, "Again")) > 0  # slots are free again

    asyncio.run(burst())
    assert core.max_held == bound and len(core.added) == bound + 1


def test_n_counts_against_the_bound(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]]) -> None:
    engine, core = make_engine(max_num_seqs=2, max_num_queued_reqs=1)
    core.paused.set()

    async def run() -> None:
        gen = engine.generate("Hello", SamplingParams(n=2))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.01)
        with pytest.raises(CapacityError):
            await _collect(engine, "x", SamplingParams(n=2))
        with pytest.raises(InvalidRequestError):
            await _collect(engine, "x", SamplingParams(n=4))  # could never fit
        first.cancel()

    asyncio.run(run())


def test_bad_parameters_are_refused_before_admission(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]]
                                                    ) -> None:
    """Parameters are checked before any slot is taken: a full engine still answers a bad request with the field's
    400 (not a 429 to retry), and the request costs no slot."""
    engine, core = make_engine(max_num_seqs=1, max_num_queued_reqs=0)
    core.paused.set()

    async def run() -> None:
        gen = engine.generate("Hello", GREEDY)
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.01)
        assert engine.num_in_flight == 1
        with pytest.raises(InvalidRequestError) as info:
            await _collect(engine, "x", SamplingParams(temperature=-1.0))
        assert info.value.param == "temperature" and engine.num_in_flight == 1
        first.cancel()

    asyncio.run(run())


def test_cancelled_consumer_aborts_in_core(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]]) -> None:
    engine, core = make_engine(FakeCore(step_delay=0.002))

    async def run() -> None:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("Hello", LONG, "c"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_for(lambda: core.num_requests() == 0 and engine.num_in_flight == 0)

    asyncio.run(run())
    assert core.aborted == [("c", RequestStatus.FINISHED_ABORTED)]


def test_closed_generator_aborts_in_core(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]]) -> None:
    engine, core = make_engine(FakeCore(step_delay=0.002))

    async def run() -> None:
        gen = engine.generate("Hello", SamplingParams(n=2, max_tokens=100, ignore_eos=True), "g")
        await gen.__anext__()
        await gen.aclose()
        await _wait_for(lambda: core.num_requests() == 0 and engine.num_in_flight == 0)

    asyncio.run(run())
    assert sorted(core.aborted) == [("g-0", RequestStatus.FINISHED_ABORTED), ("g-1", RequestStatus.FINISHED_ABORTED)]


def test_abort_ends_the_stream(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]]) -> None:
    engine, core = make_engine(FakeCore(step_delay=0.002))

    async def run() -> RequestOutput:
        outputs = []
        async for out in engine.generate("Hello", LONG, "x"):
            outputs.append(out)
            if len(outputs) == 1:
                await engine.abort("x")
        await engine.abort("unknown")  # ignored
        return outputs[-1]

    final = asyncio.run(run())
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert core.num_requests() == 0 and engine.num_in_flight == 0


def test_bad_requests_free_their_slot(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]]) -> None:
    engine, core = make_engine(max_num_seqs=1, max_num_queued_reqs=0)

    async def run() -> None:
        for prompt in ("", [1, 10**6]):
            with pytest.raises(InvalidRequestError):
                await _collect(engine, prompt)
        assert engine.num_in_flight == 0
        core.paused.set()
        gen = engine.generate("Hello", GREEDY, "dup")
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.01)
        with pytest.raises(CapacityError):
            await _collect(engine, "Hello", request_id="dup")
        first.cancel()

    asyncio.run(run())
    assert core.added == ["dup"]


def test_duplicate_request_id_refused(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]]) -> None:
    engine, core = make_engine()
    core.paused.set()

    async def run() -> None:
        gen = engine.generate("Hello", GREEDY, "same")
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.01)
        with pytest.raises(InvalidRequestError, match="in use"):
            await _collect(engine, "Hello", request_id="same")
        first.cancel()

    asyncio.run(run())


def test_dead_loop_fails_pending_and_new_requests(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]]) -> None:
    engine, core = make_engine(FakeCore(fail_at_step=3))

    async def run() -> list[BaseException | list[RequestOutput]]:
        return await asyncio.gather(*(_collect(engine, "Hello", LONG) for _ in range(3)), return_exceptions=True)

    results = asyncio.run(run())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert not engine.is_healthy()
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(engine, "Hello"))


def test_shutdown_fails_waiting_requests(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]]) -> None:
    engine, core = make_engine()
    core.paused.set()

    async def run() -> None:
        task = asyncio.ensure_future(_collect(engine, "Hello"))
        await asyncio.sleep(0.01)
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            await task
        with pytest.raises(EngineDeadError):
            await _collect(engine, "Hello")

    asyncio.run(run())
    assert core.shut_down and not engine.is_healthy()


def test_idle_loop_blocks_instead_of_spinning(make_engine: Callable[..., tuple[AsyncEngine, FakeCore]]) -> None:
    engine, core = make_engine()
    asyncio.run(_collect(engine, "Hello"))
    time.sleep(0.02)
    calls = core.has_unfinished_calls
    time.sleep(0.1)
    assert core.has_unfinished_calls == calls
    assert len(asyncio.run(_collect(engine, "Hello again"))) > 0  # wakes up for new work (on a new event loop)
