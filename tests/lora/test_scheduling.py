"""The scheduler admits a request only when its adapter holds a device slot: at most `max_loras` distinct adapters
run in one step, slots are reused without reloading, and an unused slot goes to a new adapter least recently
released first. Host only (no model)."""

from __future__ import annotations

from jengine.cache.kv_cache_manager import KVCacheManager
from jengine.config import SchedulerConfig
from jengine.lora.request import LoRARequest
from jengine.lora.slots import LoraSlotTable
from jengine.request import Request, RequestStatus
from jengine.sampling.params import SamplingParams

ADAPTERS = {name: LoRARequest(name, i + 1, f"/{name}") for i, name in enumerate("abc")}


def _scheduler(max_loras: int):
    from jengine.scheduler.scheduler import Scheduler

    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64)
    return Scheduler(config, KVCacheManager(64, 4), LoraSlotTable(max_loras))


def _add(scheduler, rid: str, adapter: str | None) -> Request:
    request = Request(rid, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True),
                      lora_request=ADAPTERS.get(adapter))
    scheduler.add_request(request)
    return request


def _adapters_of(scheduler, sched) -> set[str | None]:
    return {scheduler.requests[r].lora_name for r in sched.num_scheduled_tokens}


def test_at_most_max_loras_adapters_per_step():
    scheduler = _scheduler(max_loras=2)
    for rid, adapter in (("a1", "a"), ("b1", "b"), ("c1", "c"), ("base", None), ("a2", "a")):
        _add(scheduler, rid, adapter)
    first = scheduler.schedule()
    assert _adapters_of(scheduler, first) == {"a", "b"}  # c waits for a slot, and FCFS holds the rest behind it
    assert first.lora_loads == {0: "a", 1: "b"}
    assert [n.lora_slot for n in first.new_requests] == [0, 1]
    scheduler.finish_requests(["b1"], RequestStatus.FINISHED_ABORTED)
    second = scheduler.schedule()
    assert second.lora_loads == {1: "c"}  # b's slot had no user left
    assert {n.request_id: n.lora_slot for n in second.new_requests} == {"c1": 1, "base": -1, "a2": 0}
    for sched_step in range(2):
        assert len(_adapters_of(scheduler, scheduler.schedule()) - {None}) <= 2, sched_step


def test_a_resident_adapter_is_reused_without_loading():
    scheduler = _scheduler(max_loras=2)
    _add(scheduler, "a1", "a")
    _add(scheduler, "b1", "b")
    scheduler.schedule()
    scheduler.finish_requests(["a1", "b1"], RequestStatus.FINISHED_ABORTED)
    _add(scheduler, "a2", "a")
    assert scheduler.schedule().lora_loads == {}  # still in slot 0
    _add(scheduler, "c1", "c")
    assert scheduler.schedule().lora_loads == {1: "c"}  # slot 1 (b) was the idle one
    assert scheduler.stats().running_loras == ("a", "c")


def test_preemption_gives_the_slot_back():
    scheduler = _scheduler(max_loras=1)
    request = _add(scheduler, "a1", "a")
    scheduler.schedule()
    scheduler._preempt(request)
    assert scheduler.lora_slots.in_use("a") == 0 and request.lora_slot == -1
    assert scheduler.stats().waiting_loras == ("a",)
    request.num_pending_tokens = 0  # the token in flight when it was preempted has arrived
    again = scheduler.schedule()
    assert [n.lora_slot for n in again.new_requests] == [0] and again.lora_loads == {}
