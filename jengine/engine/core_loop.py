"""The engine core on its own thread: commands in through a queue, step outputs out through a callback.

The thread owns the `EngineCore` exclusively (it is single-threaded), so the front end never touches it: adds and
aborts travel as commands. When the core has no work the thread blocks on the queue (no busy spin); while it has work
it drains whatever commands arrived, then steps. Any exception in the core ends the loop and is reported once through
`on_dead`: a core in an unknown state must not keep serving. A process boundary can later replace the thread behind
the same interface.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from jengine.engine.stats import EngineStats
from jengine.engine.core import EngineCoreOutput
from jengine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

OutputsCallback = Callable[[list[EngineCoreOutput]], None]
DeadCallback = Callable[[BaseException], None]
StatsReader = Callable[[], EngineStats]


class CoreLike(Protocol):
    """What the loop needs of `EngineCore` (tests pass a fake with the same methods)."""

    def add_request(self, request: Request, *, enforce_queue_bound: bool = True) -> None: ...
    def abort(self, request_ids: list[str], status: RequestStatus = ...) -> list[EngineCoreOutput]: ...
    def step(self) -> list[EngineCoreOutput]: ...
    def has_unfinished(self) -> bool: ...
    def shutdown(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class _Add:
    children: list[Request]


@dataclasses.dataclass(frozen=True)
class _Abort:
    request_ids: list[str]
    status: RequestStatus


@dataclasses.dataclass(frozen=True)
class _Stop:
    pass


@dataclasses.dataclass(frozen=True)
class _Call:
    """Run `fn(core)` on the core thread between steps (adapter loads and unloads); its result or error goes to
    `future`."""

    fn: Callable[[CoreLike], Any]
    future: concurrent.futures.Future


_Command = _Add | _Abort | _Stop | _Call


class CoreLoop:
    """Drives one core on a daemon thread; `on_outputs` and `on_dead` are called on that thread."""

    def __init__(self, core: CoreLike, on_outputs: OutputsCallback, on_dead: DeadCallback,
                 name: str = "jengine-core", read_stats: StatsReader | None = None) -> None:
        """`read_stats` runs on the core thread after every iteration; its result is published as `stats`."""
        self._core = core
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._read_stats = read_stats
        self.stats = read_stats() if read_stats is not None else EngineStats()  # replaced whole: atomic to read
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def add(self, children: list[Request]) -> None:
        """Queue requests for the core (the caller has admitted them; the core's own bound is not applied)."""
        self._commands.put(_Add(children))

    def abort(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Queue an abort; the core frees the requests before its next step and reports them finished."""
        if request_ids:
            self._commands.put(_Abort(list(request_ids), status))

    def call(self, fn: Callable[[CoreLike], Any]) -> concurrent.futures.Future:
        """Queue `fn(core)` for the core thread; the future holds what it returns or raises."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(fn, future))
        return future

    def shutdown(self, timeout: float = 30.0) -> bool:
        """Stop after the current step and wait for the thread; True when it has ended (the core is free then)."""
        if not self._stopped:
            self._stopped = True
            self._commands.put(_Stop())
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        ended = not self._thread.is_alive()
        if not ended:
            logger.warning("the engine core thread did not stop within %.0f s", timeout)
        return ended

    def _run(self) -> None:
        """The loop; its only exits are a stop command and an exception (reported through on_dead)."""
        try:
            while self._run_once():
                pass
        except BaseException as exc:  # the core is in an unknown state: report it and stop serving
            logger.exception("the engine core loop died")
            self._on_dead(exc)

    def _run_once(self) -> bool:
        """Apply pending commands, then step if there is work; False once stopped."""
        outputs, keep_going = self._apply(self._next_commands())
        if keep_going and self._core.has_unfinished():
            outputs.extend(self._core.step())
        if self._read_stats is not None:  # before the outputs: a caller who saw its request end sees it gone here
            self.stats = self._read_stats()
        if outputs:
            self._on_outputs(outputs)
        return keep_going

    def _next_commands(self) -> list[_Command]:
        """Everything queued; blocks for the first command only while the core is idle."""
        commands: list[_Command] = []
        if not self._core.has_unfinished():
            commands.append(self._commands.get())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[_Command]) -> tuple[list[EngineCoreOutput], bool]:
        """Adds and aborts in arrival order; (abort outputs, whether to keep running)."""
        outputs: list[EngineCoreOutput] = []
        for command in commands:
            if isinstance(command, _Stop):
                return outputs, False
            if isinstance(command, _Add):
                for request in command.children:
                    self._core.add_request(request, enforce_queue_bound=False)
            elif isinstance(command, _Call):
                _run_call(self._core, command)
            else:
                outputs.extend(self._core.abort(command.request_ids, command.status))
        return outputs, True


def _run_call(core: CoreLike, command: _Call) -> None:
    """A call's own error goes back to its caller; the core is not left in an unknown state by it. A call whose
    caller gave up before it ran is skipped."""
    if not command.future.set_running_or_notify_cancel():
        return
    try:
        command.future.set_result(command.fn(core))
    except Exception as exc:
        command.future.set_exception(exc)
