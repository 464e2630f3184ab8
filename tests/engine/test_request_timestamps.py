"""The core's scheduling timestamps on a real tiny model under preemption: a request's `first_scheduled_time` is its
first scheduling (a resumed one keeps it), the milestones are ordered, and the tokens-per-step histogram counts every
executed step. Prompts are drawn fresh each run (the seed is in every failure message)."""

from __future__ import annotations

import bisect
import time

import numpy as np
import pytest
from transformers import LlamaConfig

from jengine import LLM, SamplingParams
from jengine.engine.stats import ITERATION_TOKEN_BUCKETS
from tests.conftest import COMMON, fresh_seed
from tests.engine.test_invariance import assert_nothing_leaked

SEED = fresh_seed()
# A small pool forces preemption; a small budget chunks the prefills.
PRESSURED = dict(max_num_seqs=8, max_num_batched_tokens=16, num_gpu_blocks_override=10, block_size=16)


@pytest.fixture(scope="module")
def model_dir(build_checkpoint, tiny_tokenizer_dir):
    return build_checkpoint(LlamaConfig(**{**COMMON, "max_position_embeddings": 256}),
                            tokenizer_dir=tiny_tokenizer_dir)[0]


class ScheduleSpy:
    """Wraps the scheduler's `schedule`: when each request appeared as new (first and resumed), and each step's size."""

    def __init__(self, scheduler) -> None:
        self._schedule = scheduler.schedule
        self.appearances: dict[str, list[tuple[float, float]]] = {}  # id → (before, after) of each schedule call
        self.step_sizes: list[int] = []
        scheduler.schedule = self

    def __call__(self):
        before = time.monotonic()
        sched = self._schedule()
        after = time.monotonic()
        for new in sched.new_requests:
            self.appearances.setdefault(new.request_id, []).append((before, after))
        if sched.total_num_scheduled_tokens:
            self.step_sizes.append(sched.total_num_scheduled_tokens)
        return sched


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_first_scheduled_time_survives_preemption(model_dir, async_scheduling: bool) -> None:
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(3, COMMON["vocab_size"], size=int(n)).tolist() for n in rng.integers(20, 40, size=6)]
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, seed=0, async_scheduling=async_scheduling,
              **PRESSURED)
    core = llm._core
    spy = ScheduleSpy(core.scheduler)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_nothing_leaked(llm)
    assert core.scheduler.num_preemptions_total > 0, f"the small pool should preempt (seed {SEED})"
    resumed = [rid for rid, seen in spy.appearances.items() if len(seen) > 1]
    assert resumed, f"some request should have been rescheduled after a preemption (seed {SEED})"
    for out in outputs:
        rid = out.request_id  # n=1: the core request has the request's id
        first_before, first_after = spy.appearances[rid][0]
        m = out.metrics
        assert first_before <= m.first_scheduled_time <= first_after + 0.5, f"{rid} (seed {SEED})"
        if len(spy.appearances[rid]) > 1:  # resumed later: its stamp is still the first scheduling
            assert m.first_scheduled_time < spy.appearances[rid][1][0], f"{rid} (seed {SEED})"
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        assert m.queue_time + m.prefill_time + m.decode_time == pytest.approx(m.last_token_time - m.arrival_time)
    expected = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    for size in spy.step_sizes:
        expected[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, size)] += 1
    assert core.step_tokens.counts == expected and core.step_tokens.total_tokens == sum(spy.step_sizes)
