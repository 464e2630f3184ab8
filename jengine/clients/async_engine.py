"""`AsyncEngine`: the in-process `EngineClient` that servers stream from.

A request's path: its parameters checked and its slots reserved synchronously (before any tokenising, so a burst can
never overfill the engine) → `EngineFront` (tokenize, fan out, track) → the core loop thread → core outputs handed
back to the event loop with `call_soon_threadsafe` → `EngineFront.collect` → the request's own asyncio queue → the
caller's `async for`.
A caller that stops iterating (client gone, task cancelled) aborts its request in the core. If the core loop dies,
every waiting caller gets `EngineDeadError` and so does every new call: never a silent hang with /health at 200.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from jengine.config import EngineConfig
from jengine.clients.protocol import ModelInfo, request_in_use
from jengine.engine.stats import EngineStats
from jengine.engine.core import EngineCore, EngineCoreOutput
from jengine.engine.core_loop import CoreLoop, StatsReader
from jengine.front.front import EngineFront
from jengine.front.input_processor import ProcessedRequest, PromptInput
from jengine.errors import CapacityError, EngineDeadError, InvalidRequestError, NotFoundError
from jengine.lora.request import LoRARequest
from jengine.outputs import RequestOutput, RequestOutputKind
from jengine.request import RequestStatus
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jengine.factory import EngineParts

logger = logging.getLogger(__name__)

_StreamItem = RequestOutput | EngineDeadError


@dataclasses.dataclass(eq=False)
class _Stream:
    """The consumer side of one request: its queue and the core ids of its choices."""

    request_id: str
    child_ids: list[str]
    queue: asyncio.Queue[_StreamItem]
    done: bool = False  # finished, failed or given up by the consumer: nothing more is delivered


class AsyncEngine:
    """Serves one event loop at a time (re-bound when idle); the core runs on its own thread.

    State is touched on the event loop thread; a lock makes the rare calls from elsewhere (the core thread once the
    loop has closed, `shutdown` from another thread) safe, and costs nothing uncontended.
    """

    def __init__(self, parts: EngineParts, *, max_n: int = 16) -> None:
        self._parts = parts
        self._front = EngineFront.from_parts(parts, max_n, RequestOutputKind.DELTA)
        sched = parts.config.scheduler
        self._bound = sched.max_num_seqs + sched.max_num_queued_reqs
        self._reserved = 0  # core requests (choices) admitted and not yet reported finished by the core
        self._live_children: set[str] = set()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.RLock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: EngineDeadError | None = None
        self._shut_down = False
        # adapters requests may name; the core holds their weights (reads and unloads run on its thread)
        self._loras: dict[str, LoRARequest] = {r.lora_name: r for r in _core_loras(parts.core)}
        self._core_loop = CoreLoop(parts.core, self._outputs_from_core, self._death_from_core,
                                   read_stats=_stats_reader(parts.core))
        self._core_loop.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Build the model, cache and core (minutes for a large model), then start the loop."""
        from jengine.factory import build_engine  # imports jax: only when an engine is really built

        return cls(build_engine(config))

    # ------------------------------------------------------------------ EngineClient
    async def generate(self, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Stream delta outputs (the last has finished=True); leaving the loop early aborts the request.
        `lora_request`: an adapter added before (`add_lora`, --lora-modules); None: the base model."""
        if sampling_params is not None and sampling_params.structured_outputs is not None:
            # Compiling a grammar (and, the first time, the tokenizer's llguidance view) takes a while: off the loop;
            # the check at admission then finds it compiled.
            await asyncio.get_running_loop().run_in_executor(None, self._front.compile_grammar, sampling_params)
        # From this check to the core's queue nothing awaits: an unload queued after it finds this request there.
        if lora_request is not None and self._loras.get(lora_request.lora_name) != lora_request:
            raise NotFoundError(f"no LoRA adapter named {lora_request.lora_name!r} is loaded", code="lora_not_found")
        stream = self._admit(prompt, sampling_params or SamplingParams(), request_id, priority, lora_request)
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, EngineDeadError):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._detach(stream)

    async def abort(self, request_id: str) -> None:
        """Abort in the core; the stream ends with a finished output whose finish_reason is "abort"."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None and self._dead is None:
                self._core_loop.abort(stream.child_ids)

    def get_tokenizer(self) -> Tokenizer:
        return self._parts.tokenizer

    def get_model_info(self) -> ModelInfo:
        model = self._parts.config.model
        return ModelInfo(model.served_model_name or model.model, model.model,
                         self._parts.config.scheduler.max_model_len, self._front.vocab_size, model.max_logprobs,
                         dict(self._parts.sampling_defaults), model.served_model_aliases, self._bound,
                         self._parts.config.chat_parsing)

    def is_healthy(self) -> bool:
        return self._dead is None

    # ------------------------------------------------------------------ LoRA adapters (LoraClient)
    def list_loras(self) -> list[LoRARequest]:
        return list(self._loras.values())

    def allows_runtime_lora_updating(self) -> bool:
        lora = self._parts.config.lora
        return lora.enable_lora and lora.allow_runtime_lora_updating

    async def add_lora(self, request: LoRARequest) -> None:
        """Reads and checks the adapter on the core thread, between steps; then requests may name it."""
        self._raise_if_dead()
        await asyncio.wrap_future(self._core_loop.call(lambda core: core.add_lora(request)))
        self._loras[request.lora_name] = request

    async def remove_lora(self, name: str) -> None:
        """Refused while requests use the adapter (they keep running under it); new requests stop finding it at
        once, and find it again if the core refuses."""
        self._raise_if_dead()
        request = self._loras.pop(name, None)
        if request is None:
            raise NotFoundError(f"no LoRA adapter named {name!r} is loaded", code="lora_not_found")
        try:
            await asyncio.wrap_future(self._core_loop.call(lambda core: core.remove_lora(name)))
        except BaseException:
            self._loras.setdefault(name, request)
            raise

    def stats(self) -> EngineStats:
        """The snapshot the core thread published after its latest step (never touches the core itself)."""
        return self._core_loop.stats

    def shutdown(self) -> None:
        """Stop the core loop, free the core, and fail whatever is still waiting with EngineDeadError."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            if self._dead is None:
                self._dead = EngineDeadError("the engine was shut down")
        if self._core_loop.shutdown():
            self._parts.core.shutdown()
        self._call_on_loop(self._fail_all)

    # ------------------------------------------------------------------ introspection
    @property
    def num_in_flight(self) -> int:
        """Core requests admitted and not yet finished in the core (what the admission bound counts)."""
        return self._reserved

    @property
    def num_streams(self) -> int:
        """Requests whose caller still waits for outputs."""
        return len(self._streams)

    # ------------------------------------------------------------------ admission
    def _admit(self, prompt: PromptInput, params: SamplingParams, request_id: str | None,
               priority: int, lora_request: LoRARequest | None = None) -> _Stream:
        """Check the parameters, reserve slots (atomic: no await before the increment), then tokenize."""
        with self._lock:
            self._raise_if_dead()
            self._front.check(params)  # a bad request is a 400 even when the engine is full
            self._bind_loop()
            slots = self._reserve(params.n)
        try:
            processed = self._front.prepare(prompt, params, request_id or uuid.uuid4().hex, priority=priority,
                                            arrival_time=time.monotonic())
            for child in processed.children:
                child.lora_request = lora_request
            with self._lock:
                self._raise_if_dead()
                self._check_unique(processed)
                return self._submit(processed)
        except BaseException:
            with self._lock:
                if self._dead is None:  # a dead engine has already forgotten every reservation
                    self._reserved -= slots
            raise

    def _reserve(self, n: int) -> int:
        """Take `n` slots (a checked n) or refuse at once."""
        if n > self._bound:
            raise InvalidRequestError(f"n={n} is more than this engine holds at once ({self._bound})", param="n")
        if self._reserved + n > self._bound:
            raise CapacityError(f"the engine is full ({self._bound} requests running or queued); retry later")
        self._reserved += n
        return n

    def _check_unique(self, processed: ProcessedRequest) -> None:
        if processed.request_id in self._streams or not self._live_children.isdisjoint(processed.child_ids):
            raise request_in_use(processed.request_id)

    def _submit(self, processed: ProcessedRequest) -> _Stream:
        child_ids = processed.child_ids
        stream = _Stream(processed.request_id, child_ids, asyncio.Queue())
        self._streams[processed.request_id] = stream
        self._live_children.update(child_ids)
        self._front.submit(processed, self._core_loop.add)
        return stream

    def _detach(self, stream: _Stream) -> None:
        """The consumer left (finished, cancelled, or broke out): abort in the core if it still runs there."""
        with self._lock:
            if stream.done:
                return
            stream.done = True
            self._streams.pop(stream.request_id, None)
            if self._dead is None:
                logger.debug("request %s abandoned by its consumer; aborting", stream.request_id)
                self._core_loop.abort(stream.child_ids)

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise _copy_dead(self._dead)

    def _bind_loop(self) -> None:
        """Use the caller's loop; a different loop may take over only when nobody waits on the old one."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self._streams:
                raise RuntimeError("this AsyncEngine is serving requests on another event loop")
            self._loop = loop

    # ------------------------------------------------------------------ outputs (from the core thread)
    def _outputs_from_core(self, outputs: list[EngineCoreOutput]) -> None:
        """Core thread: hand the batch to the event loop."""
        self._call_on_loop(lambda: self._handle_outputs(outputs))

    def _handle_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Event loop: free finished slots, build RequestOutputs, stop stop-string hits, feed the queues."""
        with self._lock:
            if self._dead is not None:
                return
            try:
                self._release_finished(outputs)
                for request_output in self._front.collect(outputs, self._stop_in_core):
                    self._deliver(request_output)
            except Exception as exc:  # a bug on our side of the queue: every request would hang, so fail them
                logger.exception("output processing failed")
                self._dead = _dead_error("output processing failed", exc)
                self._core_loop.shutdown(timeout=0)
                self._fail_all()

    def _stop_in_core(self, child_ids: list[str]) -> None:
        self._core_loop.abort(child_ids, RequestStatus.FINISHED_STOPPED)

    def _release_finished(self, outputs: list[EngineCoreOutput]) -> None:
        """A slot is free once the core reports its request finished (aborts included): the bound stays exact."""
        for out in outputs:
            if out.finish_reason is not None and out.request_id in self._live_children:
                self._live_children.discard(out.request_id)
                self._reserved -= 1

    def _deliver(self, request_output: RequestOutput) -> None:
        stream = self._streams.get(request_output.request_id)
        if stream is None:  # the consumer left; its request is being aborted
            return
        stream.queue.put_nowait(request_output)
        if request_output.finished:
            stream.done = True
            del self._streams[request_output.request_id]

    # ------------------------------------------------------------------ death
    def _death_from_core(self, exc: BaseException) -> None:
        """Core thread: mark dead at once (new calls fail from now on), then fail the waiting requests."""
        with self._lock:
            if self._dead is None:
                self._dead = _dead_error("the engine core loop stopped", exc)
        self._call_on_loop(self._fail_all)

    def _fail_all(self) -> None:
        """Every waiting request gets its own EngineDeadError; the engine holds nothing afterwards."""
        with self._lock:
            assert self._dead is not None
            streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                stream.done = True
                stream.queue.put_nowait(_copy_dead(self._dead))
            self._front.reset()
            self._live_children.clear()
            self._reserved = 0

    def _call_on_loop(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the event loop thread; directly when already there, or when no loop can run it any more."""
        loop = self._loop
        if loop is None or loop.is_closed() or _running_loop() is loop:
            fn()
            return
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # closed between the check and the call
            fn()


def _stats_reader(core: object) -> StatsReader | None:
    """Reads an `EngineCore`'s scheduler and KV-cache counters (on the core thread); None for other cores (fakes)."""
    if not isinstance(core, EngineCore):
        return None

    max_loras = core.config.lora.max_loras if core.adapters is not None else 0

    def read() -> EngineStats:
        sched, kv = core.stats(), core.kv_manager
        prefix, spec = kv.prefix_cache_stats, core.scheduler.spec_counts
        return EngineStats(sched.num_running, sched.num_waiting, sched.kv_cache_usage, sched.num_preemptions_total,
                           prefix.queries, prefix.hits, kv.num_blocks, kv.block_size, tuple(core.step_tokens.counts),
                           core.step_tokens.total_tokens, max_loras, sched.running_loras, sched.waiting_loras,
                           spec_decode_num_drafts=spec.num_drafts, spec_decode_num_draft_tokens=spec.num_draft_tokens,
                           spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
                           spec_decode_num_accepted_tokens_per_pos=tuple(spec.accepted_per_pos))

    return read


def _core_loras(core: object) -> list[LoRARequest]:
    """The adapters a core was built with (--lora-modules); none for cores without LoRA (test fakes too)."""
    list_loras = getattr(core, "list_loras", None)
    return list_loras() if list_loras is not None else []


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _dead_error(what: str, cause: BaseException) -> EngineDeadError:
    """A client-safe message (the exception type, no paths or reprs); the cause stays chained for the log."""
    error = EngineDeadError(f"{what} ({type(cause).__name__}); see the server log")
    error.__cause__ = cause
    return error


def _copy_dead(error: EngineDeadError) -> EngineDeadError:
    """A fresh instance per raise, so tracebacks of different requests do not pile up on one object."""
    copy = EngineDeadError(str(error))
    copy.__cause__ = error.__cause__
    return copy
