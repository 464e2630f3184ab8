"""The scheduler with the real KV-cache manager and a fake runner (no model, no jax)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jengine.cache.kv_cache_manager import KVCacheManager
from jengine.config import SchedulerConfig
from jengine.errors import CapacityError
from jengine.request import Request, RequestStatus
from jengine.sampling.params import SamplingParams
from jengine.scheduler.output import RunnerOutput, SchedulerOutput
from jengine.scheduler.scheduler import RequestUpdate, Scheduler

BLOCK = 4


class FakeRunner:
    """Tracks each request's known and computed tokens from the step diffs; samples `(last token + 1) % 97`."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.steps: list[SchedulerOutput] = []

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.steps.append(sched)
        for request_id in sched.finished_request_ids | sched.preempted_request_ids:
            self.tokens.pop(request_id, None)
        for new in sched.new_requests:
            self.tokens[new.request_id] = list(new.token_ids)
            self.computed[new.request_id] = new.num_computed_tokens
        for cached in sched.cached_requests:
            assert self.computed[cached.request_id] == cached.num_computed_tokens
        ids, sampled = [], []
        for request_id, count in sched.num_scheduled_tokens.items():
            self.computed[request_id] += count
            known = self.tokens[request_id]
            assert self.computed[request_id] <= len(known), "scheduled past the known tokens"
            token = [(known[-1] + 1) % 97] if self.computed[request_id] == len(known) else []
            known.extend(token)
            ids.append(request_id)
            sampled.append(token)
        return RunnerOutput(ids, sampled, [None] * len(ids), {})


class PipelinedDriver:
    """Steps the scheduler the way the pipelined engine does: step N+1 is scheduled and run before step N's output
    is applied. The fake runner knows its own samples at once, as the device does."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner) -> None:
        self.scheduler, self.runner = scheduler, runner
        self.in_flight: tuple[SchedulerOutput, RunnerOutput] | None = None

    def step(self) -> list[RequestUpdate]:
        sched = self.scheduler.schedule()
        out = self.runner.execute(sched)
        done, self.in_flight = self.in_flight, None if sched.is_empty else (sched, out)
        return self.scheduler.update_from_output(*done) if done else []


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=32, max_model_len=128, queued=100, prefix=True):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_num_queued_reqs=queued, max_model_len=max_model_len)
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=prefix)
    return Scheduler(config, kv), kv


def request(rid: str, prompt: list[int], max_tokens: int = 5, priority: int = 0, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), priority=priority)


def run_until_done(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000,
                   pipelined: bool = False) -> dict[str, list[int]]:
    """Every request's output tokens; fails if a request gets tokens after its finishing update."""
    outputs: dict[str, list[int]] = {}
    ended: set[str] = set()
    driver = PipelinedDriver(scheduler, runner)
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            break
        if pipelined:
            updates = driver.step()
        else:
            sched = scheduler.schedule()
            updates = scheduler.update_from_output(sched, runner.execute(sched))
        for update in updates:
            request_id = update.request.request_id
            assert request_id not in ended, f"{request_id} got tokens after it finished"
            outputs.setdefault(request_id, []).extend(update.new_token_ids)
            if update.finished:
                ended.add(request_id)
    assert not scheduler.has_unfinished()
    return outputs


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = (last + 1) % 97
        out.append(last)
    return out


def test_scheduler_does_not_import_jax():
    code = ("import sys, jengine.scheduler.scheduler, jengine.scheduler.codec; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_budget_is_shared_and_long_prompts_are_chunked():
    scheduler, kv = make_scheduler(budget=8)
    runner = FakeRunner()
    scheduler.add_request(request("long", list(range(1, 21)), max_tokens=3))
    scheduler.add_request(request("short", [5, 6], max_tokens=3))
    outputs = run_until_done(scheduler, runner)
    assert all(step.total_num_scheduled_tokens <= 8 for step in runner.steps)
    long_chunks = [s.num_scheduled_tokens["long"] for s in runner.steps if "long" in s.num_scheduled_tokens]
    assert long_chunks[:3] == [8, 8, 4]
    assert outputs["long"] == expected_tokens(list(range(1, 21)), 3)
    assert outputs["short"] == expected_tokens([5, 6], 3)
    assert kv.num_free_blocks == 64


def test_decodes_are_scheduled_before_new_prefills():
    scheduler, _ = make_scheduler(budget=6)
    runner = FakeRunner()
    scheduler.add_request(request("a", [1, 2, 3], max_tokens=4))
    scheduler.update_from_output(sched := scheduler.schedule(), runner.execute(sched))
    scheduler.add_request(request("b", list(range(10, 30)), max_tokens=1))
    sched = scheduler.schedule()
    assert list(sched.num_scheduled_tokens) == ["a", "b"]
    assert sched.num_scheduled_tokens == {"a": 1, "b": 5}


def test_max_num_seqs_bounds_running_requests():
    scheduler, _ = make_scheduler(max_num_seqs=2, budget=64)
    runner = FakeRunner()
    for i in range(5):
        scheduler.add_request(request(f"r{i}", [i + 1, i + 2], max_tokens=3))
    while scheduler.has_unfinished():
        sched = scheduler.schedule()
        assert len(sched.num_scheduled_tokens) <= 2
        scheduler.update_from_output(sched, runner.execute(sched))


@pytest.mark.parametrize("pipelined", [False, True])
def test_preemption_recomputes_and_keeps_generated_tokens(pipelined):
    scheduler, kv = make_scheduler(num_blocks=10, max_num_seqs=8, budget=64, prefix=False)
    runner = FakeRunner()
    prompts = {f"r{i}": [10 * i + j for j in range(1, 8)] for i in range(4)}
    for rid, prompt in prompts.items():
        scheduler.add_request(request(rid, prompt, max_tokens=12))
    outputs = run_until_done(scheduler, runner, pipelined=pipelined)
    assert scheduler.num_preemptions_total > 0
    for rid, prompt in prompts.items():
        assert outputs[rid] == expected_tokens(prompt, 12)
    assert kv.num_free_blocks == 10
    resumed = [n for s in runner.steps for n in s.new_requests if n.num_output_tokens > 0]
    assert resumed, "a preempted request should come back with its generated tokens"


def test_queue_bound_refuses_one_more():
    scheduler, _ = make_scheduler(max_num_seqs=2, queued=3)
    for i in range(5):
        scheduler.add_request(request(f"r{i}", [1, 2]))
    with pytest.raises(CapacityError):
        scheduler.add_request(request("one-more", [1, 2]))


def test_each_request_brings_its_choice_index_and_gets_an_engine_counter():
    scheduler, _ = make_scheduler()
    for index, rid in enumerate(["a", "b"]):
        scheduler.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=2), choice_index=index + 1))
    new = scheduler.schedule().new_requests
    assert [(n.request_id, n.choice_index, n.request_counter) for n in new] == [("a", 1, 0), ("b", 2, 1)]


def test_abort_frees_blocks_of_running_and_waiting_requests():
    scheduler, kv = make_scheduler(max_num_seqs=1)
    runner = FakeRunner()
    scheduler.add_request(request("running", list(range(1, 10))))
    scheduler.add_request(request("waiting", [1, 2]))
    scheduler.update_from_output(sched := scheduler.schedule(), runner.execute(sched))
    assert kv.num_free_blocks < 64
    finished = scheduler.finish_requests(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in finished} == {"running", "waiting"}
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in finished)
    assert kv.num_free_blocks == 64 and not scheduler.has_unfinished()
    assert scheduler.schedule().finished_request_ids == {"running", "waiting"}


def test_priority_orders_waiting_requests():
    scheduler, _ = make_scheduler(max_num_seqs=1, budget=64)
    runner = FakeRunner()
    scheduler.add_request(request("late-urgent", [1], max_tokens=1, priority=-1))
    scheduler.add_request(request("first", [2], max_tokens=1, priority=0))
    scheduler.add_request(request("urgent", [3], max_tokens=1, priority=-1))
    order = []
    while scheduler.has_unfinished():
        sched = scheduler.schedule()
        order += [n.request_id for n in sched.new_requests]
        scheduler.update_from_output(sched, runner.execute(sched))
    assert order == ["late-urgent", "urgent", "first"]


@pytest.mark.parametrize("pipelined", [False, True])
def test_stop_rules(pipelined):
    """Stops end the output exactly where the serial engine ends it; blocks come back once."""
    scheduler, kv = make_scheduler()
    runner = FakeRunner()
    eos_req = Request("eos", [3], SamplingParams(max_tokens=10), eos_token_ids=frozenset({6}))
    min_req = Request("min", [3], SamplingParams(max_tokens=10, min_tokens=5), eos_token_ids=frozenset({5}))
    stop_req = Request("stop", [3], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    one_req = request("one", [3, 4], max_tokens=1)
    for r in (eos_req, min_req, stop_req, one_req):
        scheduler.add_request(r)
    outputs = run_until_done(scheduler, runner, pipelined=pipelined)
    assert outputs["eos"] == [4, 5, 6] and eos_req.status == RequestStatus.FINISHED_STOPPED
    assert outputs["min"] == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13] and min_req.status == RequestStatus.FINISHED_LENGTH
    assert outputs["stop"] == [4, 5, 6, 7] and stop_req.status == RequestStatus.FINISHED_STOPPED
    assert outputs["one"] == [5] and one_req.status == RequestStatus.FINISHED_LENGTH
    assert kv.num_free_blocks == 64
    kv.check_invariants()


def test_pipelined_schedule_counts_the_token_in_flight():
    """Scheduled again before its sampled token is known, a request decodes that pending token; a request whose
    pending tokens reach max_tokens is not scheduled again (the step would be wasted)."""
    scheduler, _ = make_scheduler()
    runner = FakeRunner()
    scheduler.add_request(request("a", [1, 2, 3], max_tokens=3))
    scheduler.add_request(request("b", [7, 8], max_tokens=1))
    first = scheduler.schedule()
    first_out = runner.execute(first)
    assert first.num_scheduled_tokens == {"a": 3, "b": 2}
    second = scheduler.schedule()  # neither token is on the host yet
    assert second.num_scheduled_tokens == {"a": 1}, "a decodes its pending token; b is done once it arrives"
    second_out = runner.execute(second)
    updates = scheduler.update_from_output(first, first_out)
    assert [(u.request.request_id, u.new_token_ids, u.finished) for u in updates] == [("a", [4], False),
                                                                                     ("b", [9], True)]
    assert scheduler.schedule().num_scheduled_tokens == {"a": 1}
    assert [u.new_token_ids for u in scheduler.update_from_output(second, second_out)] == [[5]]


def test_preempted_while_its_token_is_in_flight_keeps_the_token():
    scheduler, kv = make_scheduler(num_blocks=3, budget=64, prefix=False)
    runner = FakeRunner()
    driver = PipelinedDriver(scheduler, runner)
    scheduler.add_request(request("a", [1, 2, 3], max_tokens=8))
    scheduler.add_request(request("b", [5, 6, 7], max_tokens=8))
    preempted_updates = []
    outputs: dict[str, list[int]] = {}
    while scheduler.has_unfinished():
        for update in driver.step():
            outputs.setdefault(update.request.request_id, []).extend(update.new_token_ids)
            if update.request.status == RequestStatus.PREEMPTED:
                preempted_updates.append(update.request.request_id)
    assert preempted_updates == ["b"], "b's token sampled before its preemption arrives while it waits"
    assert outputs == {"a": expected_tokens([1, 2, 3], 8), "b": expected_tokens([5, 6, 7], 8)}
    resumed = [n for step in runner.steps for n in step.new_requests if n.request_id == "b" and n.num_output_tokens]
    assert resumed and resumed[0].token_ids == [5, 6, 7, 8, 9], "b resumes with both of its tokens"
    assert kv.num_free_blocks == 3


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, aborts and steps never leak a block; every admitted request ends."""

    pipelined = False

    def __init__(self) -> None:
        super().__init__()
        self.scheduler, self.kv = make_scheduler(num_blocks=12, max_num_seqs=4, budget=10, max_model_len=40)
        self.runner = FakeRunner()
        self.driver = PipelinedDriver(self.scheduler, self.runner)
        self.admitted: dict[str, Request] = {}
        self.ended: set[str] = set()
        self.counter = 0

    @rule(prompt=st.lists(st.integers(1, 3), min_size=1, max_size=14), max_tokens=st.integers(1, 8),
          priority=st.integers(0, 1))
    def arrive(self, prompt, max_tokens, priority):
        rid = f"r{self.counter}"
        self.counter += 1
        req = request(rid, prompt, max_tokens=max_tokens, priority=priority)
        self.scheduler.add_request(req)
        self.admitted[rid] = req

    @precondition(lambda self: self.admitted)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.admitted)))
        self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    @rule()
    def step(self):
        if self.pipelined:
            updates = self.driver.step()
        else:
            sched = self.scheduler.schedule()
            updates = self.scheduler.update_from_output(sched, self.runner.execute(sched))
        for update in updates:
            assert update.request.request_id not in self.ended, "tokens after the request ended"
            if update.finished:
                self.ended.add(update.request.request_id)

    @invariant()
    def blocks_are_consistent(self):
        self.kv.check_invariants()
        held = {b for r in self.scheduler.running for b in self.kv.block_ids(r.request_id)}
        assert self.kv.num_free_blocks + len(held) == 12

    def teardown(self):
        for _ in range(500):
            if not self.scheduler.has_unfinished():
                break
            self.step()
        assert not self.scheduler.has_unfinished()
        assert all(r.is_finished for r in self.admitted.values())
        assert self.kv.num_free_blocks == 12
        for r in self.admitted.values():
            assert r.num_output_tokens <= r.sampling_params.max_tokens
            if r.status != RequestStatus.FINISHED_ABORTED:
                assert r.output_token_ids == expected_tokens(r.prompt_token_ids, r.num_output_tokens)
                assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == min(
                    r.sampling_params.max_tokens, 40 - r.num_prompt_tokens)


class PipelinedSchedulerMachine(SchedulerMachine):
    """The same, with each step's output applied only after the next step was scheduled."""

    pipelined = True


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestPipelinedSchedulerMachine = PipelinedSchedulerMachine.TestCase
TestPipelinedSchedulerMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
