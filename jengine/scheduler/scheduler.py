"""The continuous-batching scheduler: one rule, no prefill/decode phases.

Every step each request's computed tokens catch up with its known tokens under one token budget
(`max_num_batched_tokens`): running requests first (a decode needs one token, an unfinished prefill gets the next
chunk), then waiting ones in priority/FCFS order while slots and budget last. When the KV pool cannot hold a running
request's next tokens, the lowest-priority, latest request is preempted: its blocks are freed and it is recomputed
later with its generated tokens kept. Pure host Python; never imports jax.

Tokens in flight: a request scheduled to sample holds one *pending* token until `update_from_output` brings its id.
A pending token counts as known, so the engine may schedule the next step before the previous step's tokens reach
the host (the runner feeds them on the device); run serially, every pending token arrives before the next schedule.
"""

from __future__ import annotations

import dataclasses
import logging

from jengine.cache.kv_cache_manager import KVCacheManager
from jengine.config import SchedulerConfig
from jengine.errors import CapacityError
from jengine.lora.slots import LoraSlotTable
from jengine.request import Request, RequestStatus, StopRule
from jengine.scheduler.output import (
    CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput, TokenLogprobs,
)
from jengine.scheduler.policy import WaitingQueue
from jengine.scheduler.speculation import SpecDecodeCounts, drafts_to_schedule

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request: the core turns these into engine outputs."""

    request: Request
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[TokenLogprobs | None] | None
    finished: bool


@dataclasses.dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    running_loras: tuple[str, ...] = ()  # adapters of the running requests (LoRA enabled), sorted
    waiting_loras: tuple[str, ...] = ()


def _adapter_names(requests) -> tuple[str, ...]:
    return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 lora_slots: LoraSlotTable | None = None) -> None:
        """`lora_slots`: the adapters' device slots (LoRA enabled); a request is admitted only with one."""
        self.config = config
        self.kv = kv_manager
        self.lora_slots = lora_slots
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()
        self._next_counter = 0
        self.num_preemptions_total = 0
        self.spec_counts = SpecDecodeCounts()
        self._kept_blocks: dict[str, int] = {}  # blocks left after draft rollbacks, for the next step's diff

    # ---------------------------------------------------------------- requests in and out
    def add_request(self, request: Request, *, enforce_queue_bound: bool = True) -> None:
        """Queues a request; refuses it at once (CapacityError) when the engine already holds its bound."""
        bound = self.config.max_num_seqs + self.config.max_num_queued_reqs
        if enforce_queue_bound and len(self.requests) >= bound:
            raise CapacityError(f"the engine is full ({bound} requests running or queued); retry later")
        self.requests[request.request_id] = request
        request.request_counter = self._next_counter
        request.stop_rule = StopRule.of(request, self.config.max_model_len)
        self._next_counter += 1
        self.waiting.push(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Aborts (or stops) requests wherever they are; their blocks are freed at once."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def holds_drafts(self) -> bool:
        """Whether a running request has proposed tokens waiting to be verified."""
        return any(request.spec_token_ids for request in self.running)

    def stats(self) -> SchedulerStats:
        if self.lora_slots is None:
            return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, self.num_preemptions_total)
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, self.num_preemptions_total,
                              _adapter_names(self.running), _adapter_names(self.waiting))

    # ---------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        cached: list[CachedRequestData] = []
        new: list[NewRequestData] = []
        preempted: set[str] = set()
        spec_tokens: dict[str, list[int]] = {}
        lora_loads: dict[int, str] = {}

        budget = self._schedule_running(budget, scheduled, cached, preempted, spec_tokens)
        if not preempted:
            self._schedule_waiting(budget, scheduled, new, lora_loads)
        finished, self._finished_ids = self._finished_ids, set()
        kept, self._kept_blocks = self._kept_blocks, {}
        return SchedulerOutput(new, cached, scheduled, sum(scheduled.values()), finished, preempted - finished,
                               lora_loads, spec_tokens, {r: n for r, n in kept.items() if r in self.requests})

    def _schedule_running(self, budget: int, scheduled: dict[str, int], cached: list[CachedRequestData],
                          preempted: set[str], spec_tokens: dict[str, list[int]]) -> int:
        """Running requests in order; only those that got new blocks join `cached` (the diff lists changes only).

        Runs once per running request per step, so the common decode (room in its last block) costs one check.
        """
        running, has_room = self.running, self.kv.has_room  # locals: hot loop
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            request_id, computed = request.request_id, request.num_computed_tokens
            pending = request.num_pending_tokens
            num_known = len(request.all_token_ids) + pending
            num_new = num_known - computed
            if num_new <= 0 or pending and num_known >= request.stop_rule.max_num_tokens:
                index += 1  # nothing to compute, or it stops for length once its pending tokens arrive: skip
                continue
            samples = num_new <= budget
            if not samples:
                num_new = budget
            # drafts follow a request's last token: never while that token is still pending (a pipelined step)
            drafts = (drafts_to_schedule(request, budget) if request.spec_token_ids and num_new == 1 and not pending
                      else None)
            if drafts:
                num_new += len(drafts)
            if not has_room(request, num_new):
                new_blocks = self._allocate_or_preempt(request, num_new, index, preempted)
                if new_blocks is None:  # the request itself was preempted
                    continue
                if new_blocks:
                    cached.append(CachedRequestData(request_id, new_blocks, computed))
            scheduled[request_id] = num_new
            if drafts:
                spec_tokens[request_id] = drafts
            if samples:
                request.num_pending_tokens = pending + 1
            request.num_computed_tokens = computed + num_new
            budget -= num_new
            index += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int, index: int, preempted: set[str]) -> list[int] | None:
        """Blocks for `num_new` more tokens, preempting the latest lower-priority requests until they fit.

        Victims come from the requests not yet scheduled this step (`running[index:]`, which holds `request`).
        """
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            victim = max(self.running[index:], key=self.waiting.sort_key)
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None

    def _schedule_waiting(self, budget: int, scheduled: dict[str, int], new: list[NewRequestData],
                          lora_loads: dict[int, str]) -> None:
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.num_pending_tokens:  # preempted while its last token was in flight: wait for it
                break
            lora = request.lora_name
            if lora is not None and not self.lora_slots.can_acquire(lora):  # every slot serves running requests
                break
            computed_blocks, num_cached = [], 0
            if request.sampling_params.prompt_logprobs is None:  # cached positions would have no prompt logprobs
                computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget)
            new_blocks = self.kv.allocate_slots(request, num_new, computed_blocks)
            if new_blocks is None:
                break
            self.waiting.pop()
            if lora is not None:
                request.lora_slot, load = self.lora_slots.acquire(lora)
                if load:
                    lora_loads[request.lora_slot] = lora
            if request.status == RequestStatus.WAITING:
                request.num_cached_prompt_tokens = num_cached
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached + num_new  # NewRequestData below says where this step starts
            self.running.append(request)
            scheduled[request.request_id] = num_new
            if num_cached + num_new == request.num_tokens:  # this step samples its next token
                request.num_pending_tokens = 1
            new.append(NewRequestData(
                request.request_id, list(request.all_token_ids), request.num_prompt_tokens,
                self.kv.block_ids(request.request_id), num_cached, request.sampling_params,
                request.choice_index, request.num_output_tokens, request.eos_token_ids, request.request_counter,
                request.lora_slot,
            ))
            budget -= num_new

    def _release_lora_slot(self, request: Request) -> None:
        if request.lora_slot >= 0:
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = -1

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self._release_lora_slot(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.push(request)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)

    # ---------------------------------------------------------------- after the step
    def update_from_output(self, sched: SchedulerOutput, out: RunnerOutput) -> list[RequestUpdate]:
        """Appends sampled tokens, applies stop rules, frees finished requests' blocks.

        Later steps may have been scheduled meanwhile: a request that finishes here has its later work discarded
        (it is gone from `requests`), and one preempted since gets its token all the same (it resumes with it)."""
        updates = []
        prompt_logprobs, spec_tokens = out.prompt_logprobs, sched.scheduled_spec_tokens
        for request_id, tokens, logprobs in zip(out.request_ids, out.sampled_token_ids, out.logprobs, strict=True):
            request = self.requests.get(request_id)
            if request is None:  # finished or aborted since it was scheduled (`_finish` removes it)
                continue
            prompt = prompt_logprobs.get(request_id) if prompt_logprobs else None
            if prompt:
                prompt = self._unsent_prompt_logprobs(request, prompt)
            if tokens:
                request.num_pending_tokens -= 1
                drafts = spec_tokens.get(request_id) if spec_tokens else None
                if drafts:
                    self._roll_back(request, len(drafts), len(tokens) - 1)
                tokens, finished = self._append_output(request, tokens)
                updates.append(RequestUpdate(request, tokens, [logprobs] * len(tokens), prompt, finished))
                if not finished and (out.draft_token_ids or request.spec_token_ids):  # older guesses are stale
                    request.spec_token_ids = out.draft_token_ids.get(request_id, [])
            elif prompt:
                updates.append(RequestUpdate(request, tokens, [], prompt, False))
        return updates

    def _roll_back(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Forget the K/V of rejected drafts: they count as not computed, and blocks left empty are freed."""
        self.spec_counts.record(num_drafts, num_accepted)
        request.num_computed_tokens -= num_drafts - num_accepted
        kept = self.kv.trim(request, request.num_computed_tokens)
        if kept is not None:
            self._kept_blocks[request.request_id] = kept

    @staticmethod
    def _unsent_prompt_logprobs(request: Request, entries: list[TokenLogprobs | None]) -> list[TokenLogprobs | None]:
        """The entries of one prefill chunk not delivered before: a request preempted during or after its prefill
        recomputes its prompt from position 0 (a chunk starting with None), and those positions were sent once."""
        start = 0 if entries[0] is None else request.prompt_logprobs_received  # position 0: a new pass
        sent = request.prompt_logprobs_sent
        request.prompt_logprobs_received = received = start + len(entries)
        request.prompt_logprobs_sent = max(sent, received)
        return entries[max(sent - start, 0):]

    def _append_output(self, request: Request, tokens: list[int]) -> tuple[list[int], bool]:
        """Appends sampled tokens one by one, applying the stop rules after each (a verification step brings
        several: those after a stop are dropped); returns the tokens kept and whether the request finished."""
        status = None
        for index in range(len(tokens)):
            request.append_output(tokens[index : index + 1])
            if request.stop_rule.may_stop(request):
                status = self._stop_status(request)
                if status is not None:
                    tokens = tokens[: index + 1]
                    break
        if status is None:
            return tokens, False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:  # preempted after the step that sampled this token was dispatched
            self.waiting.remove(request)
        self._finish(request, status)
        return tokens, True

    def _stop_status(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= (params.min_tokens or 0):
            if (not params.ignore_eos and last in request.eos_token_ids) or last in (params.stop_token_ids or ()):
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self._release_lora_slot(request)
        self.requests.pop(request.request_id, None)
        self.waiting.forget(request.request_id)
        self._finished_ids.add(request.request_id)
