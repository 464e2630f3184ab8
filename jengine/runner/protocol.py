"""`StepRunner`: what the engine core asks of a runner. The core calls nothing else.

`ModelRunner` runs steps on this process's devices; `PublishingRunner` (`multi_process.py`) runs them and makes the
other processes of a multi-process engine run them too. The core holds either without knowing which.
"""

from __future__ import annotations

from typing import Any, Protocol

from jengine.scheduler.output import RunnerOutput, SchedulerOutput


class StepRunner(Protocol):
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """One step, serially: launch it and wait for its tokens."""
        ...

    def dispatch(self, sched: SchedulerOutput) -> Any | None:
        """Launches a step without waiting for the device; a handle for `fetch`, or None when nothing is scheduled."""
        ...

    def fetch(self, step: Any) -> RunnerOutput:
        """Waits for a dispatched step's tokens (handles are fetched in dispatch order)."""
        ...

    def shutdown(self) -> None:
        """The engine stops: end whatever runs beside this process's steps (other processes' replays)."""
        ...
