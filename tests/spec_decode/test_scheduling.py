"""The scheduler's side of speculation, host only (no model): drafts count in the token budget and stay within a
request's length limit, rejected drafts are rolled back with their emptied blocks freed, tokens after a stop are
dropped, and the acceptance counters follow vLLM's meanings."""

from __future__ import annotations

from jengine.cache.kv_cache_manager import KVCacheManager
from jengine.config import SchedulerConfig
from jengine.request import Request
from jengine.sampling.params import SamplingParams
from jengine.scheduler.output import RunnerOutput, SchedulerOutput
from jengine.scheduler.scheduler import Scheduler

BLOCK = 4


def decoding_request(scheduler: Scheduler, prompt_len: int = 6, **params) -> Request:
    """A request past its prefill: its first token sampled, drafts not yet proposed."""
    request = Request("r", list(range(10, 10 + prompt_len)), SamplingParams(ignore_eos=True, **params))
    scheduler.add_request(request)
    sched = scheduler.schedule()
    scheduler.update_from_output(sched, RunnerOutput(["r"], [[50]], [None], {}))
    return request


def step(scheduler: Scheduler, tokens: list[int], drafts: list[int] | None = None) -> SchedulerOutput:
    sched = scheduler.schedule()
    out = RunnerOutput(["r"], [tokens], [None], {}, {"r": drafts} if drafts else {})
    scheduler.update_from_output(sched, out)
    return sched


def make_scheduler(budget: int = 64, num_blocks: int = 32) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64),
                     KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True))


def test_drafts_count_in_the_budget_and_rejected_ones_free_their_blocks():
    scheduler = make_scheduler()
    request = decoding_request(scheduler)  # 7 tokens known, 6 computed
    request.spec_token_ids = [1, 2, 3, 4, 5, 6]
    blocks_before = scheduler.kv.num_free_blocks
    sched = step(scheduler, [1, 9])  # one draft accepted, then a correction
    assert sched.num_scheduled_tokens == {"r": 7} and sched.total_num_scheduled_tokens == 7
    assert sched.scheduled_spec_tokens == {"r": [1, 2, 3, 4, 5, 6]}
    assert scheduler.kv.num_free_blocks == blocks_before, "13 slots took 2 more blocks; 8 computed keep 2"
    assert request.output_token_ids == [50, 1, 9] and request.num_computed_tokens == 8
    assert scheduler.schedule().kept_blocks == {"r": 2}, "the runner learns which blocks remain"
    scheduler.kv.check_invariants()
    assert scheduler.spec_counts.num_drafts == 1 and scheduler.spec_counts.num_draft_tokens == 6
    assert scheduler.spec_counts.num_accepted_tokens == 1 and scheduler.spec_counts.accepted_per_pos == [1] + [0] * 5


def test_drafts_are_cut_to_the_budget_and_the_length_limit():
    scheduler = make_scheduler(budget=3)
    request = decoding_request(scheduler, prompt_len=3, max_tokens=5)
    request.spec_token_ids = [1, 2, 3, 4]
    assert step(scheduler, [1, 2, 3]).scheduled_spec_tokens == {"r": [1, 2]}, "budget 3: one token, two drafts"
    request.spec_token_ids = [4, 5, 6]
    assert step(scheduler, [4]).scheduled_spec_tokens == {}, "4 of max_tokens=5 out: only one more token"
    assert request.is_finished


def test_tokens_after_a_stop_token_are_dropped():
    scheduler = make_scheduler()
    request = Request("r", list(range(10, 16)), SamplingParams(stop_token_ids=[7]))
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), RunnerOutput(["r"], [[50]], [None], {}))
    request.spec_token_ids = [5, 7, 8]
    sched = scheduler.schedule()
    updates = scheduler.update_from_output(sched, RunnerOutput(["r"], [[5, 7, 8, 9]], [None], {}))
    assert updates[0].new_token_ids == [5, 7] and updates[0].finished
    assert request.output_token_ids == [50, 5, 7]
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_preemption_drops_drafts():
    scheduler = make_scheduler(num_blocks=3)
    request = decoding_request(scheduler, prompt_len=7)  # 8 tokens: 2 blocks
    request.spec_token_ids = [1, 2, 3, 4, 5]
    other = Request("s", list(range(20, 24)), SamplingParams())
    scheduler.add_request(other, enforce_queue_bound=False)
    sched = scheduler.schedule()  # r needs 4 more slots (13 tokens: 4 blocks > 3): preempted
    assert "r" in sched.preempted_request_ids and request.spec_token_ids == []
    assert sched.scheduled_spec_tokens == {}
