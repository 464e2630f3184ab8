"""`EngineCore`: owns the scheduler, the KV-cache manager and the runner, and joins them in `step()`.

The scheduler and the runner never call each other. Serially a step is schedule → execute → update; pipelined
(below) it is schedule N+1 → dispatch N+1 → fetch N → update N.
Token ids in, token ids out: text never enters the core.

Pipelined (`async_scheduling`, the default), a step schedules and dispatches step N+1 before it fetches step N's
tokens and applies them: the host's bookkeeping for N and N+2 runs while the device computes N+1. The scheduler
counts N's samples as pending tokens and the runner feeds them to N+1 on the device, so outputs equal the serial
engine's; what N+1 computes for a request that N finished is discarded.

With speculative decoding, a step that verifies drafts runs to completion before the next one is scheduled (the
proposer needs its accepted tokens); prompt lookup pipelines the steps in between, while it has nothing to verify.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from jengine.cache.kv_cache_manager import KVCacheManager
from jengine.config import EngineConfig
from jengine.engine.stats import StepTokenCounts
from jengine.errors import InvalidRequestError
from jengine.lora.host_cache import AdapterCache
from jengine.lora.request import LoRARequest
from jengine.lora.slots import LoraSlotTable
from jengine.request import Request, RequestStatus
from jengine.runner.protocol import StepRunner
from jengine.scheduler.output import RunnerOutput, SchedulerOutput, TokenLogprobs
from jengine.scheduler.scheduler import Scheduler, SchedulerStats
from jengine.structured.masks import MaskFiller, StepMasks

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request. A plain message, not frozen: one is built per request per step, and a
    frozen dataclass's __init__ (object.__setattr__ per field) costs several times more."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # one per new token when the request asked for logprobs
    prompt_logprobs: list[TokenLogprobs | None] | None  # positions of this prefill chunk (first prompt token: none)
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    timestamp: float
    first_scheduled_time: float | None = None  # on a request's first output only: when it was first scheduled


class EngineCore:
    """Single-threaded: callers (the core loop thread, or `LLM`) own it exclusively."""

    def __init__(self, config: EngineConfig, runner: StepRunner, num_blocks: int,
                 adapters: AdapterCache | None = None) -> None:
        """`adapters`: the LoRA adapters the engine knows (LoRA enabled; the runner loads its slots from them)."""
        self.config = config
        self.kv_manager = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.adapters = adapters
        slots = None if adapters is None else LoraSlotTable(config.lora.max_loras)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, slots)
        self.runner = runner
        self.num_steps = 0
        speculative = config.speculative
        # A draft model proposes from each step's accepted tokens, so it runs serially; prompt lookup pipelines
        # while it finds nothing to propose (`_step_speculative`).
        self.pipelined = config.runner.async_scheduling and (speculative is None or speculative.method == "ngram")
        self.speculative = speculative is not None
        self._in_flight: tuple[SchedulerOutput, Any] | None = None  # dispatched, tokens not fetched (pipelined)
        self._landed: list[EngineCoreOutput] = []  # outputs of a step applied early, returned by the next step()
        self.step_tokens = StepTokenCounts()
        self.masks = MaskFiller()  # structured output: the constrained rows' allowed tokens, filled per step
        self._constrained: set[str] = set()  # ids of constrained requests added and maybe unfinished (pruned lazily)

    def add_request(self, request: Request, *, enforce_queue_bound: bool = True) -> None:
        if request.lora_request is not None:
            self.add_lora(request.lora_request)
        if self._in_flight is not None and request.request_id in self._in_flight[0].num_scheduled_tokens:
            self._land_in_flight()  # an earlier request of this id is in the step in flight: its outputs go first
        self.scheduler.add_request(request, enforce_queue_bound=enforce_queue_bound)
        if request.grammar is not None:
            self._constrained.add(request.request_id)

    def abort(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
              ) -> list[EngineCoreOutput]:
        now = time.monotonic()
        return [EngineCoreOutput(r.request_id, [], [], None, status.finish_reason, r.num_cached_prompt_tokens, now,
                                 r.report_first_scheduled_time())
                for r in self.scheduler.finish_requests(request_ids, status)]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_requests(self) -> int:
        return len(self.scheduler.requests)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache, e.g. between benchmark runs); refused (False)
        while a request holds blocks."""
        return self.kv_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, request: LoRARequest) -> None:
        """Reads and checks an adapter (once per name); AdapterError when it cannot be served."""
        if self.adapters is None:
            raise InvalidRequestError("LoRA adapters need an engine started with enable_lora", param="lora_request")
        self.adapters.add(request)

    def remove_lora(self, name: str) -> None:
        """Forgets an adapter. Refused while requests use it (running or waiting): they would lose their weights."""
        if self.adapters is None:
            raise InvalidRequestError("LoRA adapters need an engine started with enable_lora", param="lora_name")
        users = sum(r.lora_name == name for r in self.scheduler.requests.values())
        if users:
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use by {users} request(s); unload it once they "
                                      f"finish", param="lora_name", code="lora_in_use")
        self.adapters.remove(name)
        self.scheduler.lora_slots.forget(name)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.adapters is None else self.adapters.known()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def step(self) -> list[EngineCoreOutput]:
        """One step's outputs: this step's when serial, the previous step's when pipelined."""
        if self.pipelined:
            return self._step_speculative() if self.speculative else self._step_pipelined()
        sched = self._schedule()
        masks = self._token_masks(sched, None)
        runner_out = self.runner.execute(sched) if masks is None else self.runner.execute(sched, masks)
        if sched.is_empty:
            return []
        return self._apply(sched, runner_out)

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Schedule and dispatch the next step, then fetch and apply the one in flight (if any). With constrained
        requests scheduled, the new step's sampler waits for its masks, which need the tokens of the one in flight:
        once those are applied the masks fill on the mask thread while the device runs the new forward and this
        thread returns and prepares the step after; the runner launches the sampler just before that step's
        forward."""
        outputs, self._landed = self._landed, []
        sched = self._schedule()
        done, self._in_flight = self._in_flight, None
        masks: StepMasks | None = None

        def land() -> None:  # the new step's masks start filling as soon as the matchers have consumed its tokens
            nonlocal done
            if done is not None:
                landing, done = done, None
                outputs.extend(self._apply(landing[0], self.runner.fetch(landing[1]), masks))

        masks = self._token_masks(sched, None if done is None else land)
        launched = self.runner.dispatch(sched) if masks is None else self.runner.dispatch(sched, masks)
        self._in_flight = None if launched is None else (sched, launched)
        land()
        if masks is not None:
            masks.start()  # (already started by `land` unless nothing was in flight)
        return outputs

    def _step_speculative(self) -> list[EngineCoreOutput]:
        """Pipelined while no request holds drafts (the proposer runs on each fetched step's tokens, one step
        behind). Once one does, the step in flight lands first (its fetch proposes again from every token), and a
        step that verifies drafts runs to completion before the next is scheduled: its accepted tokens are the next
        step's inputs."""
        if self._in_flight is not None and self.scheduler.holds_drafts():
            self._land_in_flight()
        if self._in_flight is None:
            outputs, self._landed = self._landed, []
            sched = self._schedule()
            masks = self._token_masks(sched, None)  # nothing in flight: every token has been applied
            if sched.scheduled_spec_tokens:
                runner_out = self.runner.execute(sched) if masks is None else self.runner.execute(sched, masks)
                return outputs + self._apply(sched, runner_out)
            self._landed = outputs
            launched = self.runner.dispatch(sched) if masks is None else self.runner.dispatch(sched, masks)
            if launched is not None:
                self._in_flight = (sched, launched)
            return self._take_landed()
        return self._step_pipelined()

    def _take_landed(self) -> list[EngineCoreOutput]:
        outputs, self._landed = self._landed, []
        return outputs

    def _token_masks(self, sched: SchedulerOutput, land: Callable[[], None] | None) -> StepMasks | None:
        """The mask source of a step with constrained requests (None otherwise), filled once every matcher has
        consumed every earlier token: with nothing in flight (`land` None) it starts filling at once, while the
        runner prepares and runs the forward; else the caller starts it after applying the step in flight (`land`),
        or it applies that step itself when asked first. A grammar that waits for the end of a
        reasoning span counts only while a step is in flight (its tokens may end the span); with every token
        applied, a batch whose grammars all wait runs free."""
        if not self._constrained:  # the free engine's step: no per-request work at all
            return None
        requests = self.scheduler.requests
        self._constrained.intersection_update(requests)
        scheduled = [requests.get(request_id) for request_id in sched.num_scheduled_tokens]
        if not any(r is not None and r.grammar is not None and (land is not None or r.grammar.active)
                   for r in scheduled):
            return None
        masks = StepMasks(self.masks, scheduled, land)
        if land is None:
            masks.start()
        return masks

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's plan; requests scheduled for the very first time are stamped (a request resumed after a
        preemption keeps its first stamp: its queue time ends once)."""
        sched = self.scheduler.schedule()
        if sched.new_requests:
            now, requests = time.monotonic(), self.scheduler.requests
            for new in sched.new_requests:
                request = requests[new.request_id]
                if request.num_preemptions == 0 and request.first_scheduled_time is None:
                    request.first_scheduled_time = now
        return sched

    def _land_in_flight(self) -> None:
        """Fetch and apply the step in flight now (the host waits for it); its outputs come with the next step."""
        (sched, launched), self._in_flight = self._in_flight, None
        self._landed += self._apply(sched, self.runner.fetch(launched))

    def _apply(self, sched: SchedulerOutput, runner_out: RunnerOutput, next_masks: StepMasks | None = None
               ) -> list[EngineCoreOutput]:
        """The step's outputs; `next_masks`: the next step's mask source, started once the matchers have consumed
        this step's tokens (its fill runs while the outputs are built)."""
        updates = self.scheduler.update_from_output(sched, runner_out)
        if self._constrained:  # the free engine's step: no per-request work at all
            self.masks.advance([(u.request, u.new_token_ids) for u in updates if u.request.grammar is not None])
        if next_masks is not None:
            next_masks.start()
        self.num_steps += 1
        self.step_tokens.add(sched.total_num_scheduled_tokens)
        now = time.monotonic()
        return [
            EngineCoreOutput(u.request.request_id, u.new_token_ids, u.logprobs, u.prompt_logprobs,
                             u.request.status.finish_reason if u.finished else None,
                             u.request.num_cached_prompt_tokens, now, u.request.report_first_scheduled_time())
            for u in updates
        ]

    def shutdown(self) -> None:
        if self.runner is not None:  # a second shutdown finds nothing left to stop
            self.runner.shutdown()  # several processes: the workers end too
        self.runner = None
        self.masks.shutdown()
        self._in_flight = None
