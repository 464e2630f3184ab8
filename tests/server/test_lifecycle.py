"""Lifecycle: `jengine serve` as a process (SIGTERM drains and exits 0, the API key from the environment), the
CLI's model resolution, a dead engine (503), and an engine that fails after a stream has started."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from jengine.cli import _serve_model, build_parser, main
from jengine.clients.protocol import ModelInfo
from jengine.engine.stats import EngineStats
from jengine.errors import EngineDeadError
from jengine.models.demo import DEMO_MAX_POSITIONS, DEMO_SERVED_NAME
from jengine.outputs import CompletionOutput, RequestOutput
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import Tokenizer
from tests.server.conftest import Servers, ServerHandle

ROOT = Path(__file__).resolve().parents[2]
KEY = "env-key-42"
STREAMS, TOKENS = 3, 240


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports: each socket stays bound until all are chosen (ports asked for one after another
    can repeat, as the first is free again once its socket closes)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


@pytest.fixture
def serve_process(chat_model_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """`python -m jengine serve MODEL` on a free port, one request at a time, the key from $JENGINE_API_KEY."""
    port = free_port()
    args = [sys.executable, "-m", "jengine", "serve", str(chat_model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--grpc-port", "0", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "1",
            "--compile-buckets", "lazy", "--served-model-name", "tiny-served", "--drain-timeout", "60"]
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        args += ["--compilation-cache-dir", os.environ["JAX_COMPILATION_CACHE_DIR"]]
    env = dict(os.environ, PYTHONPATH=str(ROOT), JENGINE_API_KEY=KEY)
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(args, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _healthy(url):
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "jengine serve did not become healthy"
            time.sleep(0.2)
        yield process, url, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_sigterm_drains_in_flight_requests_then_exits_zero(
        serve_process: tuple[subprocess.Popen, str, Path]) -> None:
    process, url, log = serve_process
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401  # the key came from the environment
    models = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"]
    assert models[0]["id"] == "tiny-served" and models[0]["max_model_len"] == 256
    body = {"model": "tiny-served", "prompt": "Drain me", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    results: list[list[dict[str, Any]]] = [[] for _ in range(STREAMS)]

    def stream(i: int) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=120) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
            results[i] = chunks + [{"done": True}]

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while _admitted(url) < STREAMS:  # then SIGTERM: one runs, the rest wait (max_num_seqs 1)
        assert time.monotonic() < deadline, f"the requests were not all admitted: {results}\n{log.read_text()}"
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while _healthy(url):
        assert time.monotonic() < deadline, "/health did not turn 503 after SIGTERM"
        time.sleep(0.02)
    late = httpx.post(url + "/v1/completions", json={**body, "stream": False}, headers=headers, timeout=30)
    assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable_error"
    for thread in threads:
        thread.join(120)
    assert process.wait(timeout=60) == 0, log.read_text()
    output = log.read_text()
    for chunks in results:  # every in-flight request (running or queued at SIGTERM) finished whole
        assert chunks[-1] == {"done": True} and chunks[-2]["choices"][0]["finish_reason"] == "length", output
        assert len(chunks) > 2, output
    assert "draining" in output and "Traceback" not in output, output


def _admitted(url: str) -> float:
    """Requests the engine has taken: running or waiting now (the core's snapshot), or already finished."""
    samples = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if not line.startswith("#") and line:
            samples[line.split("{")[0]] = samples.get(line.split("{")[0], 0.0) + float(line.rsplit(" ", 1)[1])
    names = ("jengine:num_requests_running", "jengine:num_requests_waiting", "jengine:request_success_total")
    return sum(samples.get(name, 0.0) for name in names)


def test_serve_defaults_and_the_demo_model(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.port, args.grpc_port, args.host, args.compile_buckets) == (8000, 50051, "0.0.0.0", "auto")
    model, served_name = _serve_model(args)
    assert served_name == DEMO_SERVED_NAME
    config = json.loads((Path(model) / "config.json").read_text())
    assert config["max_position_embeddings"] >= DEMO_MAX_POSITIONS >= 2048  # served max_model_len defaults to it
    named = build_parser().parse_args(["serve", "--model", str(tmp_path), "--served-model-name", "x", "--port", "9"])
    assert _serve_model(named) == (str(tmp_path), "x") and named.port == 9


def test_cli_refuses_conflicting_models_and_bad_engine_addresses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "/a", "--model", "/b"]) == 1
    assert "either as MODEL or as --model" in capsys.readouterr().err
    assert main(["openai", "--engine", "no-port-here"]) == 1
    assert "HOST:PORT" in capsys.readouterr().err


class ScriptedClient:
    """An EngineClient with a scripted engine: healthy or dead, and failing after `fail_after` outputs."""

    def __init__(self, tokenizer: Tokenizer, *, healthy: bool = True, fail_after: int = 2) -> None:
        self.tokenizer = tokenizer
        self.healthy = healthy
        self.fail_after = fail_after

    async def generate(self, prompt: Any, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0) -> AsyncIterator[RequestOutput]:
        if not self.healthy:
            raise EngineDeadError("the engine core loop stopped (RuntimeError); see the server log")
        for step in range(self.fail_after):
            yield RequestOutput(request_id or "r", "p", [1, 5], None, [CompletionOutput(0, f"t{step}", [7], None,
                                                                                        None)], False)
        raise EngineDeadError("the engine core loop stopped (XlaRuntimeError); see the server log")

    async def abort(self, request_id: str) -> None:
        pass

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_model_info(self) -> ModelInfo:
        return ModelInfo("scripted", "/nowhere", 128, self.tokenizer.vocab_size, 20)

    def is_healthy(self) -> bool:
        return self.healthy

    def stats(self) -> EngineStats:
        return EngineStats()

    def shutdown(self) -> None:
        self.healthy = False


@pytest.fixture(scope="module")
def scripted(chat_tokenizer_dir: Path, servers: Servers) -> dict[str, ServerHandle]:
    tokenizer = Tokenizer.from_pretrained(chat_tokenizer_dir)
    return {"dead": servers.serve(ScriptedClient(tokenizer, healthy=False)),
            "failing": servers.serve(ScriptedClient(tokenizer))}


def test_a_dead_engine_answers_503(scripted: dict[str, ServerHandle]) -> None:
    dead = scripted["dead"]
    health = dead.http.get("/health")
    assert health.status_code == 503 and health.json()["error"]["type"] == "service_unavailable_error"
    response = dead.http.post("/v1/completions", json={"prompt": "Hi"})
    assert response.status_code == 503 and "engine" in response.json()["error"]["message"]
    assert response.headers["Retry-After"] and dead.http.get("/metrics").status_code == 200


def test_an_error_after_the_stream_started_ends_it_with_an_error_chunk(scripted: dict[str, ServerHandle]) -> None:
    failing = scripted["failing"]
    with failing.http.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "stream": True}) as response:
        assert response.status_code == 200
        payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    last = json.loads(payloads[-2])
    assert last["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "error",
                                "stop_reason": None}]
    assert last["error"]["type"] == "service_unavailable_error" and "XlaRuntimeError" in last["error"]["message"]
    assert [json.loads(p)["choices"][0]["delta"].get("content") for p in payloads[1:-2]] == ["t0", "t1"]
    with pytest.raises(openai.APIError, match="engine core loop stopped"):
        list(failing.client().completions.create(model="scripted", prompt="Hi", stream=True))
