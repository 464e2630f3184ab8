"""Helpers for the gRPC tests: a real AsyncEngine on a tiny model, served by `start_grpc_server` on a loopback port.

The engine and the servers live on one asyncio loop in a background thread (a grpc.aio server and the AsyncEngine both
belong to the loop they started on), so tests use plain blocking stubs from the generated code, and hand coroutines
to that loop when they need the engine itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc

from jengine.config import EngineConfig
from jengine.clients.async_engine import AsyncEngine
from jengine.outputs import RequestOutput
from jengine.sampling.params import SamplingParams
from jengine.v1 import jengine_pb2_grpc as pb_grpc
from server.grpc_service import JengineGrpcServer, start_grpc_server

T = TypeVar("T")
API_KEY = "test-key-0123"
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 8


class LoopThread:
    """An event loop running in a daemon thread; `run` executes a coroutine there and waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclasses.dataclass
class GrpcHarness:
    """One engine, one key-protected server over it, and what tests need to reach both."""

    loops: LoopThread
    engine: AsyncEngine
    server: JengineGrpcServer
    address: str
    channel: grpc.Channel

    @property
    def stub(self) -> pb_grpc.EngineStub:
        return pb_grpc.EngineStub(self.channel)

    def start_server(self, api_key: str | None = None) -> JengineGrpcServer:
        """Another server over the same engine (e.g. to drain it without disturbing the others)."""
        return self.loops.run(start_grpc_server(self.engine, "127.0.0.1", 0, api_key))

    def engine_outputs(self, prompt: Any, params: SamplingParams) -> list[RequestOutput]:
        """The in-process engine's own stream for a request: the reference the gRPC results must equal."""

        async def collect() -> list[RequestOutput]:
            return [out async for out in self.engine.generate(prompt, params)]

        return self.loops.run(collect())

    def is_idle(self) -> bool:
        """No request admitted or running, and every KV block free (reference count 0)."""
        core = self.engine._parts.core
        kv = core.kv_manager
        return self.engine.num_in_flight == 0 and not core.has_unfinished() and kv.num_free_blocks == kv.num_blocks

    def wait_idle(self, timeout: float = 1.0) -> bool:
        return wait_for(self.is_idle, timeout)


def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def auth(key: str = API_KEY) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the API key."""
    return (("authorization", f"Bearer {key}"),)


def streamed_tool_calls(deltas) -> dict[int, list[str]]:
    """The tool calls a stream of gRPC `ChatDelta`s spells, by index: [name, arguments joined]."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            if call.id:
                calls[call.index] = [call.name, ""]
            calls[call.index][1] += call.arguments
    return calls


def start_harness(model_dir: Path, **engine_kwargs: Any) -> GrpcHarness:
    """Build the engine (float32, small limits; at most MAX_NUM_SEQS requests admitted; `engine_kwargs` are further
    EngineConfig fields) and serve it with a key."""
    loops = LoopThread()
    config = EngineConfig.from_kwargs(str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN,
                                      max_num_seqs=MAX_NUM_SEQS, max_num_queued_reqs=0, **engine_kwargs)
    engine = AsyncEngine.from_config(config)
    server = loops.run(start_grpc_server(engine, "127.0.0.1", 0, API_KEY))
    address = f"127.0.0.1:{server.port}"
    return GrpcHarness(loops, engine, server, address, grpc.insecure_channel(address))


def stop_harness(harness: GrpcHarness) -> None:
    harness.channel.close()
    harness.loops.run(harness.server.stop(None))
    harness.engine.shutdown()
    harness.loops.close()
