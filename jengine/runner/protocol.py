"""`StepRunner`: what the engine core asks of a runner. The core calls nothing else.

`ModelRunner` runs steps on this process's devices; `PublishingRunner` (`multi_process.py`) runs them and makes the
other processes of a multi-process engine run them too. The core holds either without knowing which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from jengine.scheduler.output import RunnerOutput, SchedulerOutput

# Structured output: called once per step, after its forward is launched and before its sampler is (a runner asks
# as late as it can: the host fills the masks meanwhile), for (rows in scheduled order, their packed [k, words] int32
# allowed-token bits), or None when no scheduled row is constrained.
TokenMaskSource = Callable[[], tuple[np.ndarray, np.ndarray] | None]


class StepRunner(Protocol):
    def execute(self, sched: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> RunnerOutput:
        """One step, serially: launch it and wait for its tokens."""
        ...

    def dispatch(self, sched: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> Any | None:
        """Launches a step without waiting for the device; a handle for `fetch`, or None when nothing is scheduled.
        `token_masks` gives the constrained rows' allowed tokens; it is asked once, after the forward is launched
        and at the latest when the next step is dispatched or this one fetched."""
        ...

    def fetch(self, step: Any) -> RunnerOutput:
        """Waits for a dispatched step's tokens (handles are fetched in dispatch order)."""
        ...

    def shutdown(self) -> None:
        """The engine stops: end whatever runs beside this process's steps (other processes' replays)."""
        ...
