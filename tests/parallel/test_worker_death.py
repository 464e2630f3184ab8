"""A two-process engine whose worker is killed while it serves: process 0 fails every request in flight within 5 s
(a started stream with a final error chunk and [DONE], a waiting one with 503), turns /health 503, refuses new
requests, and still exits promptly on SIGTERM instead of waiting for the dead worker."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from transformers import LlamaConfig

from tests.conftest import COMMON
from tests.parallel.test_multi_host import _start, _wait_healthy
from tests.server.test_lifecycle import free_ports

FAIL_WITHIN_S = 5.0
LONG = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True, "temperature": 0}


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("jengine:num_requests_running"))


def test_a_killed_worker_fails_requests_in_flight_and_turns_health_off(build_checkpoint, tiny_tokenizer_dir,
                                                                        tmp_path: Path) -> None:
    model_dir, _ = build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=tiny_tokenizer_dir)
    coordinator_port, port = free_ports(2)
    coordinator = f"127.0.0.1:{coordinator_port}"
    logs = [tmp_path / "process0.log", tmp_path / "process1.log"]
    processes = [_start(model_dir, i, coordinator, port, logs[i]) for i in (0, 1)]
    url = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {}
    streaming = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as response:
            payloads = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    payloads.append(line[6:])
                    streaming.set()
        results["stream"] = (payloads, time.monotonic())

    def whole() -> None:
        response = httpx.post(url + "/v1/completions", json=LONG, timeout=60)
        results["whole"] = (response, time.monotonic())

    try:
        _wait_healthy(url, processes, logs)
        threads = [threading.Thread(target=stream, daemon=True), threading.Thread(target=whole, daemon=True)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while not (streaming.is_set() and _running(url) == 2):
            assert time.monotonic() < deadline, "the two requests did not start"
            time.sleep(0.01)
        processes[1].kill()
        killed = time.monotonic()
        for thread in threads:
            thread.join(FAIL_WITHIN_S)
        assert set(results) == {"stream", "whole"}, f"still waiting: {results}\n{logs[0].read_text()[-3000:]}"
        (*_, last, done), ended = results["stream"]
        assert done == "[DONE]" and json.loads(last)["error"]["type"] == "service_unavailable_error"
        response, whole_ended = results["whole"]
        assert response.status_code == 503 and "engine" in response.json()["error"]["message"]
        assert max(ended, whole_ended) - killed < FAIL_WITHIN_S
        assert httpx.get(url + "/health", timeout=5).status_code == 503
        assert httpx.post(url + "/v1/completions", json=LONG, timeout=5).status_code == 503
        processes[0].send_signal(signal.SIGTERM)
        processes[0].wait(timeout=40)  # jax's shutdown barrier gives up on the dead worker (it waited 300 s)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
