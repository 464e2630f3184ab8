"""The runners of a multi-process engine: process 0 publishes its runner calls, every other process replays them.

Each call (execute, dispatch, fetch) travels as one message on the step feed (`parallel/step_feed.py`), published
before process 0 makes it, so the workers make the same calls in the same order with the same `SchedulerOutput`
(`scheduler/codec.py`); the step's collectives keep the processes in lockstep.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

import jax

from jengine.parallel.step_feed import StepPublisher, StepSubscriber
from jengine.runner.protocol import StepRunner, TokenMaskSource
from jengine.scheduler.codec import step_from_json, step_to_json
from jengine.scheduler.output import RunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

Op = Literal["execute", "dispatch", "fetch", "stop"]


def encode_call(op: Op, sched: SchedulerOutput | None = None) -> str:
    return json.dumps({"op": op, "sched": None if sched is None else step_to_json(sched)})


def decode_call(message: str) -> tuple[Op, SchedulerOutput | None]:
    data = json.loads(message)
    return data["op"], None if data["sched"] is None else step_from_json(data["sched"])


class PublishingRunner:
    """Process 0's `StepRunner`: publishes every call before making it on the runner it wraps; its shutdown stops
    the workers."""

    def __init__(self, runner: StepRunner, publisher: StepPublisher) -> None:
        self.runner = runner
        self._publisher = publisher

    def execute(self, sched: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> RunnerOutput:
        _refuse_masks(token_masks)
        self._publisher.publish(encode_call("execute", sched))
        return self.runner.execute(sched)

    def dispatch(self, sched: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> Any | None:
        _refuse_masks(token_masks)
        self._publisher.publish(encode_call("dispatch", sched))
        return self.runner.dispatch(sched)

    def fetch(self, step: Any) -> RunnerOutput:
        self._publisher.publish(encode_call("fetch"))
        return self.runner.fetch(step)

    def shutdown(self) -> None:
        self._publisher.publish(encode_call("stop"))
        self.runner.shutdown()


def _refuse_masks(token_masks: TokenMaskSource | None) -> None:
    """The other processes would sample without the masks (they are not published): refused, never diverged."""
    if token_masks is not None:
        raise NotImplementedError("structured output is not available on a multi-process engine")


def replay(runner: StepRunner, subscriber: StepSubscriber) -> int:
    """A worker process's loop: makes process 0's runner calls on `runner` until it says stop; returns the steps
    run."""
    launched: list[Any] = []  # dispatched steps not fetched yet, oldest first (process 0 fetches in this order)
    steps = 0
    while True:
        op, sched = decode_call(subscriber.next())
        if op == "stop":
            logger.info("worker process %d: process 0 stopped after %d steps", jax.process_index(), steps)
            runner.shutdown()
            return steps
        if op == "fetch":
            runner.fetch(launched.pop(0))
            continue
        steps += 0 if sched.is_empty else 1
        if op == "execute":
            runner.execute(sched)
        else:
            step = runner.dispatch(sched)
            if step is not None:
                launched.append(step)
