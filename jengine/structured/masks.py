"""The core's side of constrained decoding: advance each request's matcher, and pack the allowed tokens of the
constrained rows of a step into an int32 bitmask (bit t of row r: token t allowed), on the host.

Matchers are llguidance `LLMatcher`s made in the front; this module imports llguidance only to advance them and fill
masks on its Rust thread pool (`LLExecutor`), never a tokenizer, so the core stays free of the text side. A step's masks
(`StepMasks`) are filled on a thread of their own once the previous step's tokens have been consumed, while the core
thread goes on preparing the next step and the device computes the forward (the fill releases the GIL); the runner
asks for them just before it launches the sampler.

A step's fill is one native call spread over llguidance's thread pool, and so is its one-token advance of every
matcher (`MaskFiller.advance`) where the pool has a few threads. The advance stays on the core thread on purpose:
Python work moved to the mask thread would run under the same GIL (the core thread would wait for it, or the mask
thread for the core thread, up to the interpreter's switch interval: 5 ms), so only the GIL-free fill runs beside the
core thread.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# How long the core thread waits for the mask thread to enter the fill: a wake-up takes tens of microseconds on an
# idle host; on a saturated one the core thread goes on after this and the fill starts when it next blocks.
HANDOFF_WAIT_S = 0.001
# A step's one-token advances go to llguidance's thread pool when it has at least this many threads; a smaller pool
# gains little over the core thread's own loop and its wake-up can wait for a busy CPU.
PARALLEL_ADVANCE_THREADS = 4


@dataclasses.dataclass(slots=True)
class RequestGrammar:
    """What a core request carries: its own matcher, advanced with every accepted token.

    With a reasoning parser, a chat reply reasons first: `reasoning_end` holds the token ids of the span's end
    marker (`</think>`, resolved by the front), and the grammar applies only to the tokens after it (the row is
    free until then). Empty: the grammar applies from the first token."""

    matcher: Any  # an llguidance LLMatcher (deep copy of the compiled one)
    vocab_words: int  # int32 words of its bitmask: ceil(tokenizer vocabulary / 32)
    kind: str  # the constraint's kind (StructuredOutputsParams.kind)
    reasoning_end: tuple[int, ...] = ()
    _recent: list[int] = dataclasses.field(default_factory=list)  # the last tokens, while the end is awaited

    @property
    def active(self) -> bool:
        """The grammar constrains the next token (the reasoning, if any, has ended)."""
        return not self.reasoning_end

    def after_reasoning(self, token_ids: Sequence[int]) -> Sequence[int]:
        """The tokens of `token_ids` the grammar must consume: all once active; while the reasoning goes on, those
        after the end marker when these tokens complete it (the grammar is active from then on), else none."""
        if not self.reasoning_end:
            return token_ids
        marker, recent = self.reasoning_end, self._recent
        for index, token in enumerate(token_ids):
            recent.append(token)
            del recent[:-len(marker)]
            if tuple(recent) == marker:
                self.reasoning_end, self._recent = (), []
                return token_ids[index + 1:]
        return ()


def _grammar_tokens(request: Any, token_ids: Sequence[int]) -> Sequence[int]:
    """The tokens of `token_ids` the request's matcher must consume (none once it has stopped)."""
    if request.grammar is None or not token_ids or request.grammar.matcher.is_stopped():
        return ()
    return request.grammar.after_reasoning(token_ids)


def _check_consumed(request: Any, consumed: bool) -> None:
    matcher = request.grammar.matcher
    if not consumed and not matcher.is_stopped():
        logger.warning("request %s: sampled token rejected by its grammar (%s)", request.request_id,
                       matcher.get_error()[:200])


def _usable_cpus() -> int:
    """The CPUs this process may run on (all of the machine's where the platform cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class MaskFiller:
    """Fills the bitmask rows of constrained requests; one per engine core (owns the llguidance thread pool)."""

    def __init__(self) -> None:
        self._executor: Any = None
        self._threads = min(32, max(1, int(0.8 * _usable_cpus())))  # llguidance's own default
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None  # runs `fill` beside the core thread

    def advance(self, updates: Sequence[tuple[Any, Sequence[int]]]) -> None:
        """Feed each (request, newly accepted tokens) of a step to the request's matcher: with a pool of
        PARALLEL_ADVANCE_THREADS threads or more, the rows that consume one token (every decode) in one call of
        llguidance's pool, which releases the GIL, instead of a Python loop of native calls; the others one by one.
        A rejected token leaves the matcher in its error state, which then allows only EOS: the output ends instead
        of going on unconstrained. Tokens of a reasoning span before the grammar applies are not fed."""
        single: list[tuple[Any, int]] = []
        owners: list[Any] = []
        parallel = self._threads >= PARALLEL_ADVANCE_THREADS
        for request, token_ids in updates:
            tokens = _grammar_tokens(request, token_ids)
            if parallel and len(tokens) == 1:
                single.append((request.grammar.matcher, tokens[0]))
                owners.append(request)
            elif tokens:
                _check_consumed(request, request.grammar.matcher.consume_tokens(list(tokens)))
        if single:
            for request, consumed in zip(owners, self._pool().consume_token_par(single)):
                if not consumed:
                    _check_consumed(request, consumed)

    def fill(self, requests: Sequence[Any]) -> tuple[np.ndarray, np.ndarray] | None:
        """(row indices, [k, words] int32 masks) for the requests whose grammar is active, in the order given
        (None: none; a None entry is a row without a request; a row still reasoning is free)."""
        batch = self._prepare(requests)
        if batch is None:
            return None
        matchers, rows, masks = batch
        self._fill_into(matchers, masks)
        return rows, masks

    def fill_later(self, requests: Sequence[Any]) -> concurrent.futures.Future:
        """`fill(requests)` on the filler's own thread (one at a time, in order); returns once that thread is inside
        llguidance's fill, which releases the GIL (a thread waiting for the GIL would otherwise get it only when this
        one blocks, or after Python's switch interval: 5 ms, longer than a decode step), or after HANDOFF_WAIT_S."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        batch = self._prepare(requests)
        if batch is None:
            future.set_result(None)
            return future
        matchers, rows, masks = batch
        inside = threading.Event()

        def run() -> tuple[np.ndarray, np.ndarray]:
            inside.set()
            self._fill_into(matchers, masks)
            return rows, masks

        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jengine-masks")
        future = self._thread.submit(run)
        inside.wait(HANDOFF_WAIT_S)
        return future

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    @staticmethod
    def _prepare(requests: Sequence[Any]) -> tuple[list[tuple[Any, int]], np.ndarray, np.ndarray] | None:
        """(matcher and mask index pairs, their rows, zeroed masks) of the active grammars; None when there are none."""
        active = [(request.grammar, row) for row, request in enumerate(requests)
                  if request is not None and request.grammar is not None and request.grammar.active]
        if not active:
            return None
        masks = np.zeros((len(active), active[0][0].vocab_words), np.int32)
        return ([(grammar.matcher, k) for k, (grammar, _) in enumerate(active)],
                np.array([row for _, row in active], np.int32), masks)

    def _fill_into(self, matchers: list[tuple[Any, int]], masks: np.ndarray) -> None:
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask_par(self._pool(), matchers, masks)

    def _pool(self) -> Any:
        """llguidance's thread pool (built on first use: a free engine never imports llguidance)."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self._threads)
        return self._executor


class StepMasks:
    """One step's token-mask source (`runner.protocol.TokenMaskSource`): its constrained rows' masks, filled once
    every earlier token has been consumed. The core starts the fill (`start`) as soon as the step in flight's tokens
    are consumed, before it builds that step's outputs; asked before that, the source applies that step first
    (`land`, which starts the fill) and waits for it."""

    def __init__(self, filler: MaskFiller, requests: Sequence[Any], land: Callable[[], None] | None) -> None:
        """`requests`: the step's scheduled requests in order (None where a row has none); `land`: applies the step
        in flight (None when every token is applied)."""
        self._filler, self._requests, self._land = filler, requests, land
        self._future: concurrent.futures.Future | None = None

    def start(self) -> None:
        """Fill on the filler's thread from now on (the matchers must not advance until the masks are taken); once
        started, later calls do nothing."""
        if self._future is None:
            self._future = self._filler.fill_later(self._requests)

    def __call__(self) -> tuple[np.ndarray, np.ndarray] | None:
        if self._future is None and self._land is not None:
            self._land()  # consumes the step in flight's tokens, then starts this fill
        self.start()
        return self._future.result()
