"""An engine whose step raises while it serves (tests/server/faults.py): every request in flight, over HTTP and
gRPC, running or queued, streamed or not, ends with an error within 5 s; health turns 503 / NOT_SERVING (Watch
streams hear it too); new requests get a clear error; nothing is left waiting."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jengine.config import EngineConfig, ServerConfig
from jengine.clients.async_engine import AsyncEngine
from jengine.v1 import jengine_pb2 as pb
from jengine.v1 import jengine_pb2_grpc as pb_grpc
from server.grpc_service import start_grpc_server
from tests.server.conftest import ENGINE_KWARGS, MODEL_NAME, ServerHandle, ServerThread, paused_core, wait_for
from tests.server.faults import FaultyRunner

FAIL_WITHIN_S = 5.0
LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclasses.dataclass
class Crashable:
    """A real engine with a FaultyRunner, behind the HTTP app and the gRPC service on one event loop."""

    http: ServerHandle
    engine: AsyncEngine
    faulty: FaultyRunner
    channel: grpc.Channel


@pytest.fixture
def crashable(chat_model_dir: Path) -> Iterator[Crashable]:
    config = EngineConfig.from_kwargs(str(chat_model_dir), served_model_name=MODEL_NAME,
                                      **{**ENGINE_KWARGS, "max_num_seqs": 3})
    engine = AsyncEngine.from_config(config)
    faulty = FaultyRunner.install(engine)
    thread = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0, grpc_port=0))
    handle = thread.start()
    grpc_server = asyncio.run_coroutine_threadsafe(
        start_grpc_server(thread.state.client, "127.0.0.1", 0), thread.loop).result(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}")
    try:
        yield Crashable(handle, engine, faulty, channel)
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(grpc_server.stop(0), thread.loop).result(30)
        thread.stop()


class Call(threading.Thread):
    """A blocking client call on its own thread; `result` is what it returned or raised, `ended` when."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._fn = fn
        self.result: Any = None
        self.ended: float | None = None
        self.started_streaming = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            self.result = self._fn()
        except Exception as exc:  # the outcome under test
            self.result = exc
        self.ended = time.monotonic()


def http_stream(url: str, call: list[Call]) -> list[str]:
    """The data payloads of a streamed completion; flags the call once the first chunk has arrived."""
    body = {"model": MODEL_NAME, "prompt": "Stream until it breaks", "stream": True, **LONG}
    payloads = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                payloads.append(line[6:])
                call[0].started_streaming.set()
    return payloads


def grpc_stream(channel: grpc.Channel, call: list[Call]) -> list[pb.GenerateResponse]:
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    replies = []
    for reply in pb_grpc.EngineStub(channel).Generate(pb.GenerateRequest(text="gRPC until it breaks",
                                                                         sampling=sampling), timeout=60):
        replies.append(reply)
        call[0].started_streaming.set()
    return replies


def start_call(fn: Callable[[list[Call]], Any]) -> Call:
    holder: list[Call] = []
    call = Call(lambda: fn(holder))
    holder.append(call)
    return call


def test_a_step_that_raises_fails_every_request_in_flight_and_turns_health_off(crashable: Crashable) -> None:
    url, engine = crashable.http.base_url, crashable.engine
    stream = start_call(lambda holder: http_stream(url, holder))
    rpc = start_call(lambda holder: grpc_stream(crashable.channel, holder))
    assert stream.started_streaming.wait(30) and rpc.started_streaming.wait(30)
    watch = health_pb2_grpc.HealthStub(crashable.channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
    assert next(watch).status == SERVING
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], **LONG}
    with paused_core(engine) as release:  # two more join: one runs (max_num_seqs 3), one waits
        running = Call(lambda: httpx.post(url + "/v1/chat/completions", json=chat, timeout=60))
        queued = Call(lambda: httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "q", **LONG},
                                         timeout=60))
        wait_for(lambda: engine.num_in_flight == 4, what="four requests admitted")
        crashable.faulty.fire()  # the step after the held one raises
        fired = time.monotonic()
        release()
    assert next(watch).status == NOT_SERVING  # a Watch opened before the failure hears of it
    for call in (stream, rpc, running, queued):
        call.join(FAIL_WITHIN_S)
        assert call.ended is not None and call.ended - fired < FAIL_WITHIN_S, f"still waiting: {call.result}"
    assert crashable.faulty.raised.is_set()

    *_, last, done = stream.result  # the started stream: a final error chunk, then [DONE]
    assert done == "[DONE]" and json.loads(last)["error"]["type"] == "service_unavailable_error"
    assert isinstance(rpc.result, grpc.RpcError) and rpc.result.code() == grpc.StatusCode.UNAVAILABLE
    for response in (running.result, queued.result):
        assert response.status_code == 503 and "engine" in response.json()["error"]["message"]
    assert_refuses_new_work(crashable)


def assert_refuses_new_work(crashable: Crashable) -> None:
    """Health says so on both front ends, new requests get a clear error at once, and nothing waits."""
    http = crashable.http.http
    assert http.get("/health").status_code == 503
    health = health_pb2_grpc.HealthStub(crashable.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == NOT_SERVING
    late = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "late"}, timeout=5)
    assert late.status_code == 503 and late.json()["error"]["code"] == "service_unavailable"
    with pytest.raises(grpc.RpcError) as refused:
        list(pb_grpc.EngineStub(crashable.channel).Generate(pb.GenerateRequest(text="late"), timeout=5))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert http.get("/metrics").status_code == 200
    assert crashable.engine.num_streams == 0 and crashable.engine.num_in_flight == 0
    assert crashable.http.state.in_flight == 0


def test_a_step_that_raises_on_the_first_request_answers_it_with_an_error(crashable: Crashable) -> None:
    crashable.faulty.fire()  # the very first step fails: before any output, before any stream header
    started = time.monotonic()
    response = crashable.http.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", **LONG})
    assert time.monotonic() - started < FAIL_WITHIN_S
    assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable_error"
    assert_refuses_new_work(crashable)
