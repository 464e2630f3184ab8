"""One engine over several processes (hosts): `jax.distributed` start-up and the step feed from process 0.

Process 0 runs the scheduler and the servers; every other process runs the same jitted steps on its own devices of
the global mesh, in the same order, with the same inputs. Process 0 publishes each step's `SchedulerOutput` (plain
data, as JSON) in the key-value store of JAX's coordination service (the service `jax.distributed` starts), and the
workers apply it to their own runner. No separate transport: the step's collectives themselves keep the processes
in lockstep, so a worker is never more than a step or two behind and old keys can be dropped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import jax
import numpy as np

from jengine.config import ParallelConfig
from jengine.errors import ConfigError
from jengine.sampling.params import SamplingParams
from jengine.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)

_KEY = "jengine/step/{}"
_KEEP = 64  # keys kept behind the newest: far more than the lockstep lets a worker lag
# A worker that dies mid-step fails process 0's step at once (its collective loses the peer), so in-flight requests
# fail and /health turns 503. Beyond that, jax's coordination service ends every process (abort) once a process has
# missed heartbeats this long (jax's default, 100 s, is how long a worker that died while process 0 was idle went
# unnoticed), and a process leaving waits this long for the others at jax's shutdown barrier (jax's default, 300 s,
# is how long process 0 hung on SIGTERM after losing a worker; a live worker gets there within seconds of the stop).
_HEARTBEAT_TIMEOUT_S = 30
_SHUTDOWN_TIMEOUT_S = 15
STOP = "stop"


def initialize(parallel: ParallelConfig) -> None:
    """Joins the processes of one engine (before any device is touched); a no-op for a single process."""
    if parallel.num_processes <= 1 or jax.distributed.is_initialized():
        return
    if not parallel.coordinator_address or parallel.process_id is None:
        raise ConfigError("num_processes > 1 needs coordinator_address and process_id (flags or environment)")
    if not 0 <= parallel.process_id < parallel.num_processes:
        raise ConfigError(f"process_id={parallel.process_id} is outside num_processes={parallel.num_processes}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU meshes across processes (GPUs: NCCL)
    jax.distributed.initialize(coordinator_address=parallel.coordinator_address,
                               num_processes=parallel.num_processes, process_id=parallel.process_id,
                               heartbeat_timeout_seconds=_HEARTBEAT_TIMEOUT_S,
                               shutdown_timeout_seconds=_SHUTDOWN_TIMEOUT_S)
    logger.info("process %d of %d joined %s: %d global devices, %d local", parallel.process_id,
                parallel.num_processes, parallel.coordinator_address, jax.device_count(), jax.local_device_count())


def agree_across_processes(plan):
    """Every process sized the KV pool from its own free memory; all must allocate the same: the smallest."""
    if jax.process_count() == 1:
        return plan
    from jax.experimental import multihost_utils

    blocks = int(multihost_utils.process_allgather(np.array([plan.num_blocks], np.int64)).min())
    return dataclasses.replace(plan, num_blocks=blocks)


def _store():
    from jax._src import distributed  # the coordination service's client (no public accessor in jax 0.11)

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


class StepPublisher:
    """Process 0's side: one message per step, numbered."""

    def __init__(self) -> None:
        self._store = _store()
        self._next = 0

    def publish(self, message: str) -> None:
        self._store.key_value_set(_KEY.format(self._next), message)
        if self._next >= _KEEP:
            self._store.key_value_delete(_KEY.format(self._next - _KEEP))
        self._next += 1


class StepSubscriber:
    """A worker's side: the messages in order; waits as long as process 0 is idle."""

    def __init__(self, poll_ms: int = 60_000) -> None:
        self._store = _store()
        self._next = 0
        self._poll_ms = poll_ms

    def next(self) -> str:
        while True:
            try:
                message = self._store.blocking_key_value_get(_KEY.format(self._next), self._poll_ms)
            except Exception as e:  # the client reports a timeout as a generic error: keep waiting
                if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                    continue
                raise
            self._next += 1
            return message


# ---------------------------------------------------------------------------------------------------------- codec
def encode_step(sched: SchedulerOutput) -> str:
    return json.dumps(_step_to_json(sched))


def decode_step(message: str) -> SchedulerOutput:
    return _step_from_json(json.loads(message))


def _step_to_json(sched: SchedulerOutput) -> dict[str, Any]:
    return {
        "new": [_new_to_json(n) for n in sched.new_requests],
        "cached": [[c.request_id, c.new_block_ids, c.num_computed_tokens] for c in sched.cached_requests],
        "scheduled": list(sched.num_scheduled_tokens.items()),
        "total": sched.total_num_scheduled_tokens,
        "finished": sorted(sched.finished_request_ids),
        "preempted": sorted(sched.preempted_request_ids),
    }


def _step_from_json(data: dict[str, Any]) -> SchedulerOutput:
    return SchedulerOutput(
        new_requests=[_new_from_json(n) for n in data["new"]],
        cached_requests=[CachedRequestData(r, blocks, computed) for r, blocks, computed in data["cached"]],
        num_scheduled_tokens=dict((r, n) for r, n in data["scheduled"]),
        total_num_scheduled_tokens=data["total"],
        finished_request_ids=set(data["finished"]),
        preempted_request_ids=set(data["preempted"]),
    )


def _new_to_json(new: NewRequestData) -> dict[str, Any]:
    fields = {f.name: getattr(new, f.name) for f in dataclasses.fields(new)}
    params = dataclasses.asdict(new.sampling_params)
    if params["logit_bias"] is not None:  # JSON keys are strings
        params["logit_bias"] = [[k, v] for k, v in params["logit_bias"].items()]
    return fields | {"sampling_params": params, "eos_token_ids": sorted(new.eos_token_ids)}


def _new_from_json(data: dict[str, Any]) -> NewRequestData:
    params = dict(data["sampling_params"])
    if params["logit_bias"] is not None:
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"]}
    return NewRequestData(**data | {"sampling_params": SamplingParams(**params),
                                    "eos_token_ids": frozenset(data["eos_token_ids"])})


# ---------------------------------------------------------------------------------------------------------- runners
def _op(op: str, sched: SchedulerOutput | None = None) -> str:
    return json.dumps({"op": op, "sched": None if sched is None else _step_to_json(sched)})


class PublishingRunner:
    """Process 0's runner: publishes every call (execute, dispatch, fetch) before making it, so the workers make
    the same calls in the same order. Everything else is the wrapped runner's (attribute access passes through)."""

    def __init__(self, runner, publisher: StepPublisher) -> None:
        self.runner = runner
        self._publisher = publisher

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute(self, sched: SchedulerOutput):
        self._publisher.publish(_op("execute", sched))
        return self.runner.execute(sched)

    def dispatch(self, sched: SchedulerOutput):
        self._publisher.publish(_op("dispatch", sched))
        return self.runner.dispatch(sched)

    def fetch(self, step):
        self._publisher.publish(_op("fetch"))
        return self.runner.fetch(step)

    def stop_workers(self) -> None:
        self._publisher.publish(_op(STOP))


def run_worker(runner, subscriber: StepSubscriber | None = None) -> int:
    """A worker process's loop: replays process 0's runner calls until it says stop; returns the steps run."""
    subscriber = subscriber or StepSubscriber()
    launched: list = []  # dispatched steps not fetched yet, oldest first (process 0 fetches in this order)
    steps = 0
    while True:
        message = json.loads(subscriber.next())
        op = message["op"]
        if op == STOP:
            logger.info("worker process %d: process 0 stopped after %d steps", jax.process_index(), steps)
            return steps
        if op == "fetch":
            runner.fetch(launched.pop(0))
            continue
        sched = _step_from_json(message["sched"])
        steps += 0 if sched.is_empty else 1
        if op == "execute":
            runner.execute(sched)
        else:
            step = runner.dispatch(sched)
            if step is not None:
                launched.append(step)


def serve_worker(config) -> int:
    """`jengine serve` on a process other than 0: build the same engine, then replay process 0's steps."""
    from jengine.factory import build_engine  # imports the model code: only in a real worker

    parts = build_engine(config)
    logger.info("worker process %d ready; following process 0", jax.process_index())
    run_worker(parts.core.runner)
    return 0
