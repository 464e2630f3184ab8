"""One engine over two processes joined by `jax.distributed` (CPU collectives), its mesh spanning both: TP = 2 with
one device per process. Process 0 serves; process 1 runs the same steps. Outputs equal one process's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from transformers import LlamaConfig

from jengine import LLM, SamplingParams
from jengine.config import EngineConfig
from jengine.runner.multi_process import PublishingRunner, replay
from jengine.scheduler.codec import decode_step, encode_step
from jengine.scheduler.output import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput
from tests.conftest import COMMON
from tests.server.test_lifecycle import free_ports

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 10


def _start(model_dir: Path, process_id: int, coordinator: str, port: int, log: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "jengine", "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--grpc-port", "0", "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4",
            "--compile-buckets", "lazy", "--served-model-name", "tiny", "--tensor-parallel-size", "2",
            "--num-processes", "2", "--process-id", str(process_id), "--coordinator-address", coordinator]
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_PLATFORMS="cpu")
    with log.open("w") as out:
        return subprocess.Popen(args, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)


def _wait_healthy(url: str, processes: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + 240
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        for process, log in zip(processes, logs):
            assert process.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, "the two-process engine did not become healthy"
        time.sleep(0.3)


def test_two_processes_serve_like_one(build_checkpoint, tiny_tokenizer_dir, tmp_path):
    model_dir, _ = build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=tiny_tokenizer_dir)
    rng = np.random.default_rng()
    prompts = [rng.integers(3, COMMON["vocab_size"], size=int(n)).tolist() for n in (3, 21, 40)]
    with LLM(str(model_dir), dtype="float32", max_model_len=128) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        expected = [o.outputs[0].text for o in outputs]

    coordinator_port, port = free_ports(2)
    coordinator = f"127.0.0.1:{coordinator_port}"
    logs = [tmp_path / "process0.log", tmp_path / "process1.log"]
    processes = [_start(model_dir, i, coordinator, port, logs[i]) for i in (0, 1)]
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, processes, logs)
        got = []
        for prompt in prompts:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            response = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            got.append(response.json()["choices"][0]["text"])
        assert got == expected
        processes[0].send_signal(signal.SIGTERM)
        assert processes[0].wait(timeout=60) == 0, logs[0].read_text()[-3000:]
        assert processes[1].wait(timeout=60) == 0, logs[1].read_text()[-3000:]
        worker_log = logs[1].read_text()
        steps = [int(line.rsplit("after ", 1)[1].split()[0]) for line in worker_log.splitlines()
                 if "process 0 stopped after" in line]
        assert steps and steps[0] >= len(prompts) * MAX_TOKENS // 4, worker_log[-3000:]  # it ran the steps
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_step_messages_round_trip():
    from jengine.sampling.params import SamplingParams as Params

    new = NewRequestData("r1", [5, 6, 7], 3, [0, 1], 0, Params(temperature=0.7, top_k=5, seed=3, stop=["x"],
                                                                logit_bias={7: 1.5}, logprobs=2),
                         1, 0, frozenset({2, 9}), 17)
    sched = SchedulerOutput([new], [CachedRequestData("r0", [4], 12)], {"r0": 1, "r1": 3}, 4, {"gone"}, {"pre"})
    assert decode_step(encode_step(sched)) == sched


class RecordingRunner:
    """A `StepRunner` that logs its calls; dispatch hands back a numbered handle."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def execute(self, sched):
        self.calls.append(("execute", sched))
        return RunnerOutput([], [], [], {})

    def dispatch(self, sched):
        self.calls.append(("dispatch", sched))
        return None if sched.is_empty else len(self.calls)

    def fetch(self, step):
        self.calls.append(("fetch", step))
        return RunnerOutput([], [], [], {})

    def shutdown(self):
        self.calls.append(("shutdown",))


class ListFeed:
    """The step feed as a list: `publish` appends, `next` pops the oldest."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def publish(self, message: str) -> None:
        self.messages.append(message)

    def next(self) -> str:
        return self.messages.pop(0)


def test_a_worker_replays_process_0s_runner_calls_in_order():
    """Process 0's runner calls, replayed by a worker, are the same calls in the same order with equal plans (each
    fetch of the handle its own dispatch returned); process 0's shutdown ends the worker's loop."""
    step = SchedulerOutput([], [CachedRequestData("r0", [4], 12)], {"r0": 1}, 1, set(), set())
    empty = SchedulerOutput([], [], {}, 0, {"r0"}, set())
    feed, leader, worker = ListFeed(), RecordingRunner(), RecordingRunner()
    published = PublishingRunner(leader, feed)
    first, second = published.dispatch(step), published.dispatch(step)
    published.fetch(first)
    published.dispatch(empty)
    published.fetch(second)
    published.execute(step)
    published.shutdown()
    assert replay(worker, feed) == 3  # non-empty steps
    assert worker.calls == leader.calls
    assert not feed.messages


def test_multi_host_flags_come_from_a_leader_worker_set(monkeypatch):
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "leader.ns.svc")
    monkeypatch.setenv("LWS_GROUP_SIZE", "4")
    monkeypatch.setenv("LWS_WORKER_INDEX", "2")
    parallel = EngineConfig.from_kwargs("/m").parallel
    assert (parallel.coordinator_address, parallel.num_processes, parallel.process_id) == ("leader.ns.svc:8476", 4, 2)
    parallel = EngineConfig.from_kwargs("/m", process_id=0, coordinator_address="h:1").parallel
    assert (parallel.coordinator_address, parallel.num_processes, parallel.process_id) == ("h:1", 4, 0)
