"""Fault injection for tests, as vLLM's shutdown tests make the model's forward raise: `FaultyRunner` wraps a real
engine's runner, and once `fire()` is called its next call (execute, dispatch or fetch) raises, so the engine step
fails the way a device error or a bug in the step would. Test instrumentation only: it is installed on one engine
object by the test that wants it, and nothing in jengine knows about it."""

from __future__ import annotations

import threading
from typing import Any

from jengine.clients.async_engine import AsyncEngine


class InjectedFault(RuntimeError):
    """What the faulty runner raises (a stand-in for an XLA runtime error)."""


class FaultyRunner:
    """Delegates everything to the wrapped runner until fired; then every step call raises."""

    def __init__(self, runner: Any) -> None:
        self._runner = runner
        self._fired = threading.Event()
        self.raised = threading.Event()  # set once a step call has actually raised

    @classmethod
    def install(cls, engine: AsyncEngine) -> FaultyRunner:
        """Put one in front of the runner of `engine`'s core (before or while it serves)."""
        core = engine._parts.core
        faulty = cls(core.runner)
        core.runner = faulty
        return faulty

    def fire(self) -> None:
        self._fired.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def _maybe_raise(self) -> None:
        if self._fired.is_set():
            self.raised.set()
            raise InjectedFault("injected fault in the engine step")

    def execute(self, sched: Any) -> Any:
        self._maybe_raise()
        return self._runner.execute(sched)

    def dispatch(self, sched: Any) -> Any:
        self._maybe_raise()
        return self._runner.dispatch(sched)

    def fetch(self, step: Any) -> Any:
        self._maybe_raise()
        return self._runner.fetch(step)
