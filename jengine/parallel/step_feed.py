"""The step feed of a multi-process engine: numbered text messages from process 0 to every other process.

Process 0 publishes each message in the key-value store of JAX's coordination service (the service
`jax.distributed` starts); the workers read them in order. No separate transport: the step's collectives themselves
keep the processes in lockstep, so a worker is never more than a step or two behind and old keys can be dropped.
"""

from __future__ import annotations

from typing import Any

_KEY = "jengine/step/{}"
_KEEP = 64  # keys kept behind the newest: far more than the lockstep lets a worker lag


def _store() -> Any:
    from jax._src import distributed  # the coordination service's client (no public accessor in jax 0.11)

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


class StepPublisher:
    """Process 0's side: one message per call, numbered."""

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
