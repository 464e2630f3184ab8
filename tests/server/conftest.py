"""Real servers on loopback: a tiny Llama checkpoint with a ChatML tokenizer, the real engine, the real app.

Each server runs its own event loop on a background thread (what `jengine serve` runs, minus the signal handling,
which tests/server/test_lifecycle.py checks on a real `jengine serve` process). Tests talk to it over HTTP with the
official `openai` client and httpx, and read the engine's published stats to check that nothing was left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import LlamaConfig

from jengine.config import EngineConfig, ServerConfig
from jengine.clients.async_engine import AsyncEngine
from jengine.clients.protocol import EngineClient
from jengine.tokenizer import CHATML_TEMPLATE, train_tiny_tokenizer
from server.app import RunningServer, ServerState, start_server
from tests.conftest import COMMON, TOKENIZER_VOCAB

MODEL_NAME = "tiny-chat"
MAX_MODEL_LEN = 256
ENGINE_KWARGS = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_queued_reqs=56)


@dataclasses.dataclass
class ServerHandle:
    """A running server: where it listens and the engine behind it."""

    base_url: str
    engine: Any  # the AsyncEngine (or a fake EngineClient) behind the app
    state: ServerState
    api_key: str | None = None
    http: httpx.Client = dataclasses.field(init=False)  # raw HTTP to this server (no key sent unless given)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.base_url, timeout=60)

    def url(self, path: str) -> str:
        return self.base_url + path

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url("/v1"), api_key=self.api_key or "unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url("/v1"), api_key=self.api_key or "unused", max_retries=0,
                                  **kwargs)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def idle(self) -> bool:
        stats = self.engine.stats()
        return (stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
                and self.engine.num_in_flight == 0 and self.engine.num_streams == 0 and self.state.in_flight == 0)

    def wait_idle(self, timeout: float = 1.0) -> None:
        """Nothing lost: no request running or queued, every KV block's reference count back to 0."""
        deadline = time.monotonic() + timeout
        while not self.idle():
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout} s: {self.engine.stats()}, "
                                     f"in flight {self.engine.num_in_flight}, http {self.state.in_flight}")
            time.sleep(0.01)


@contextlib.contextmanager
def paused_core(engine: AsyncEngine) -> Iterator[Callable[[], None]]:
    """Hold the real core at its next step while the front end keeps admitting and queueing, so a test can fill the
    engine or disconnect a queued client deterministically. Once released, the held step does nothing, so commands
    that arrived meanwhile (adds, aborts) are applied before the first real step. Test instrumentation: it shadows
    the step method of the engine's private core for a while."""
    core = engine._parts.core
    gate = threading.Event()

    def held_step() -> list:
        gate.wait()
        core.__dict__.pop("step", None)  # the class's method again from the next iteration on
        return []

    core.step = held_step
    try:
        yield gate.set  # release early from inside the block
    finally:
        gate.set()


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(server: ServerHandle) -> Samples:
    """Every sample of /metrics (parsed by prometheus_client) by (name, labels other than model_name)."""
    response = server.http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def metric(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(condition: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.005)


class ServerThread:
    """The app's own start/close on a private event loop in a daemon thread."""

    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        self.engine = engine
        self.state = ServerState.create(engine, config)
        self.loop = asyncio.new_event_loop()
        self._server: RunningServer | None = None
        self._handle: ServerHandle | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-server", daemon=True)

    def start(self) -> ServerHandle:
        """Start the thread and wait until the port is bound."""
        self._thread.start()
        assert self._started.wait(30), "server did not start"
        assert self._server is not None
        self._handle = ServerHandle(f"http://127.0.0.1:{self._server.port}", self.engine, self.state,
                                    self.state.config.api_key)
        return self._handle

    def stop(self) -> None:
        """Close the app, stop the loop, shut the engine down."""
        if self._handle is not None:
            self._handle.http.close()
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.engine.shutdown()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._server = self.loop.run_until_complete(start_server(self.state))
        self._started.set()
        self.loop.run_forever()
        for task in asyncio.all_tasks(self.loop):  # what a closed server left (nothing, normally)
            task.cancel()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"), vocab_size=TOKENIZER_VOCAB,
                                chat_template=CHATML_TEMPLATE)


@pytest.fixture(scope="session")
def chat_model_dir(build_checkpoint: Callable, chat_tokenizer_dir: Path) -> Path:
    return build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=chat_tokenizer_dir)[0]


@pytest.fixture(scope="session")
def plain_model_dir(build_checkpoint: Callable, tiny_tokenizer_dir: Path) -> Path:
    """The same weights with a tokenizer that has no chat template."""
    return build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=tiny_tokenizer_dir)[0]


class Servers:
    """Starts real servers for one test module and stops them all at its end."""

    def __init__(self) -> None:
        self._threads: list[ServerThread] = []

    def start(self, model_dir: Path, *, api_key: str | None = None, served_model_name: str = MODEL_NAME,
              server_kwargs: dict[str, Any] | None = None, **engine_kwargs: Any) -> ServerHandle:
        """The real engine over `model_dir` (ENGINE_KWARGS, overridden by `engine_kwargs`) behind the real app."""
        config = EngineConfig.from_kwargs(str(model_dir), served_model_name=served_model_name,
                                          **{**ENGINE_KWARGS, **engine_kwargs})
        return self.serve(AsyncEngine.from_config(config), api_key=api_key, **(server_kwargs or {}))

    def serve(self, client: EngineClient, *, api_key: str | None = None, **server_kwargs: Any) -> ServerHandle:
        """The real app over any EngineClient (fakes included); `server_kwargs` are further ServerConfig fields."""
        config = ServerConfig(host="127.0.0.1", port=0, grpc_port=0, api_key=api_key, **server_kwargs)
        self._threads.append(ServerThread(client, config))
        return self._threads[-1].start()

    def stop_all(self) -> None:
        for thread in self._threads:
            thread.stop()


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    started = Servers()
    yield started
    started.stop_all()


@pytest.fixture(scope="module")
def server(servers: Servers, chat_model_dir: Path) -> Iterator[ServerHandle]:
    """The main server: chat template, max_model_len 256, 8 running + 56 queued, no API key."""
    handle = servers.start(chat_model_dir)
    yield handle
    handle.wait_idle()
