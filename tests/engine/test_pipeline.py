"""The pipelined engine (`async_scheduling`: step N+1 is dispatched before step N's tokens reach the host) against
the serial engine, on a real tiny model: identical outputs for every feature that reads the token history or ends a
request, nothing lost, every KV block's reference count back to 0, and the dispatch order itself.

Prompts and seeds are drawn fresh each run (the seed is in every failure message).
"""

from __future__ import annotations

import collections
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from transformers import LlamaConfig

from jengine import LLM, SamplingParams
from jengine.config import EngineConfig
from jengine.factory import build_engine
from jengine.outputs import RequestOutput
from jengine.request import Request
from jengine.runner.input_batch import pending_token_id
from jengine.runner.step import resolve_pending
from tests.conftest import COMMON, fresh_seed
from tests.engine.test_invariance import assert_nothing_leaked

SEED = fresh_seed()
EOS = COMMON["eos_token_id"]
LOGPROB_TOLERANCE = 1e-4  # the two engines batch differently, so float32 logits may differ in the last bits
# A small pool (preemption), a small token budget (chunked prefill), prefix caching on (the default). Preemption is
# certain whatever the seed: prompt 0 (60 tokens + 12 outputs) holds 4-5 of the 8 blocks for 16 steps, in which
# the budget prefills prompts 1 and 2 (60 tokens each, 4 blocks from their 49th token) one after the other.
PRESSURED = dict(max_num_seqs=8, max_num_batched_tokens=16, num_gpu_blocks_override=8, block_size=16)
FILL_LEN = 60


@pytest.fixture(scope="module")
def model_dir(build_checkpoint, tiny_tokenizer_dir):
    config = LlamaConfig(**{**COMMON, "max_position_embeddings": 256})
    return build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir)[0]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(SEED)
    system = rng.integers(3, COMMON["vocab_size"], size=24).tolist()  # a shared prefix: prefix-cache hits
    fill_pool = [rng.integers(3, COMMON["vocab_size"], size=FILL_LEN).tolist() for _ in range(4)]
    own = [rng.integers(3, COMMON["vocab_size"], size=int(n)).tolist() for n in rng.integers(1, 40, size=6)]
    return fill_pool + [system + p for p in own[:3]] + own[3:] + [system[:16]]


def make_llm(model_dir, async_scheduling: bool, **engine_args) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_model_len=128, seed=0, async_scheduling=async_scheduling,
               **engine_args)


def generate(model_dir, prompts, params, async_scheduling: bool, **engine_args) -> tuple[list[RequestOutput], LLM]:
    llm = make_llm(model_dir, async_scheduling, **engine_args)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_nothing_leaked(llm)
    pool = llm._core.kv_manager.block_pool
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks)), f"a block is still referenced (seed {SEED})"
    return outputs, llm


def feature_params(reference: list[RequestOutput]) -> list[SamplingParams]:
    """One feature per prompt, each a way the token history matters or a request ends. Stop tokens and stop
    strings are taken from a plain greedy run, so they really stop the output mid-way."""
    common = dict(temperature=0, max_tokens=12, ignore_eos=True)
    kinds = [
        lambda ref: SamplingParams(**common),
        lambda ref: SamplingParams(**{**common, "max_tokens": 1}),
        lambda ref: SamplingParams(**{**common, "ignore_eos": False}, min_tokens=4, logit_bias={EOS: 100.0}),
        lambda ref: SamplingParams(**common, stop_token_ids=[ref.token_ids[5]]),
        lambda ref: SamplingParams(**common, stop=[stop_string(ref.text)]),
        lambda ref: SamplingParams(**common, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=2.0),
        lambda ref: SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=SEED % 1000, n=2, max_tokens=10,
                                   ignore_eos=True, logprobs=3),
        lambda ref: SamplingParams(temperature=1.0, min_p=0.05, frequency_penalty=1.0, presence_penalty=1.0,
                                   max_tokens=10, ignore_eos=True),  # unseeded: the request counter seeds it
        lambda ref: SamplingParams(**common, logprobs=4, prompt_logprobs=2),
    ]
    return [kinds[i % len(kinds)](out.outputs[0]) for i, out in enumerate(reference)]


def stop_string(text: str) -> str:
    """Two characters from the middle of a greedy text (the whole text when it is shorter)."""
    middle = len(text) // 2
    return text[middle : middle + 2] or text or "\x00"


def assert_same_outputs(serial: list[RequestOutput], pipelined: list[RequestOutput]) -> None:
    for index, (a, b) in enumerate(zip(serial, pipelined, strict=True)):
        where = f"prompt {index} (seed {SEED})"
        assert len(a.outputs) == len(b.outputs), where
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == \
                   (y.token_ids, y.text, y.finish_reason, y.stop_reason), where
            assert (x.logprobs is None) == (y.logprobs is None), where
            for p, q in zip(x.logprobs or [], y.logprobs or [], strict=True):
                assert_close_logprobs(p, q, where)
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None), where
        for p, q in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
            assert (p is None) == (q is None), where
            if p is not None:
                assert_close_logprobs(p, q, where)


def assert_close_logprobs(p: dict, q: dict, where: str) -> None:
    assert set(p) == set(q), where
    for token, logprob in p.items():
        assert abs(logprob.logprob - q[token].logprob) <= LOGPROB_TOLERANCE, where


def test_pipelined_outputs_equal_serial(model_dir, prompts):
    """Greedy and seeded sampling; EOS, max_tokens, stop tokens, stop strings and min_tokens; penalties, logit
    bias, logprobs and prompt logprobs; under preemption, chunked prefill and prefix caching."""
    reference, llm = generate(model_dir, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                              async_scheduling=False, max_num_seqs=8)
    llm.shutdown()
    params = feature_params(reference)
    runs = {}
    for pipelined in (False, True):
        outputs, llm = generate(model_dir, prompts, params, async_scheduling=pipelined, **PRESSURED)
        core = llm._core
        assert core.pipelined is pipelined
        assert core.scheduler.num_preemptions_total > 0, f"the small pool should preempt (seed {SEED})"
        assert core.kv_manager.prefix_cache_stats.hits > 0, f"shared prefixes should hit the cache (seed {SEED})"
        runs[pipelined] = outputs
        llm.shutdown()
    assert_same_outputs(runs[False], runs[True])
    for out, prompt in zip(runs[True], prompts, strict=True):  # recomputed after preemption, sent once
        assert out.prompt_logprobs is None or len(out.prompt_logprobs) == len(prompt), f"seed {SEED}"

    reasons = collections.Counter()
    for out, p in zip(runs[True], params, strict=True):
        choice = out.outputs[0]
        kind = "eos" if p.logit_bias else "token" if p.stop_token_ids else "string" if p.stop else "length"
        reasons[kind, choice.finish_reason, type(choice.stop_reason).__name__] += 1
    assert reasons["eos", "stop", "NoneType"] and reasons["token", "stop", "int"], reasons
    assert reasons["string", "stop", "str"], reasons
    eos_ended = [o.outputs[0].token_ids for o, p in zip(runs[True], params, strict=True) if p.logit_bias]
    assert all(len(t) == 5 and t[-1] == EOS for t in eos_ended), "EOS is banned for min_tokens, then forced"
    # the penalties can only show where the unpenalised greedy output repeats a token or takes one of the prompt's;
    # there, penalties this strong must change it, or the test cannot see the histories they read
    penalised = [i for i, p in enumerate(params) if p.frequency_penalty and p.temperature == 0]
    visible = [i for i in penalised if history_matters(prompts[i], reference[i].outputs[0].token_ids)]
    assert all(runs[True][i].outputs[0].token_ids != reference[i].outputs[0].token_ids for i in visible), \
        f"the penalties should change the greedy output where it repeats itself or its prompt (seed {SEED})"


def history_matters(prompt: list[int], greedy: list[int]) -> bool:
    """Whether a greedy output could differ under repetition penalties: it repeats a token, or takes a prompt's."""
    return len(set(greedy)) < len(greedy) or bool(set(greedy) & set(prompt))


class ReadRecorder:
    """A device array that logs when the host reads it (what `jax.device_get` calls)."""

    def __init__(self, array, step: int, events: list) -> None:
        self._array, self._step, self._events = array, step, events

    def copy_to_host_async(self) -> None:
        self._array.copy_to_host_async()

    def __array__(self, *args, **kwargs):
        self._events.append(("read", self._step))
        return np.asarray(self._array).__array__(*args, **kwargs)


def instrument(llm: LLM) -> list:
    """Logs each dispatch (whether its scheduled batch was empty; whether its token inputs hold pending
    placeholders) and each read of a step's sampled tokens, in order."""
    runner, events = llm._core.runner, []
    real_dispatch, real_step = runner.dispatch, runner._step

    def dispatch(sched):
        events.append(("schedule", sched.is_empty))
        return real_dispatch(sched)

    def step(params, state, batch):
        state, out = real_step(params, state, batch)
        index = sum(e[0] == "dispatch" for e in events)
        events.append(("dispatch", index, bool((np.asarray(batch.model.token_ids) < 0).any())))
        sampled = dataclasses.replace(out.sampled, token_ids=ReadRecorder(out.sampled.token_ids, index, events))
        return state, dataclasses.replace(out, sampled=sampled)

    runner.dispatch, runner._step = dispatch, step
    return events


@pytest.mark.parametrize("pipelined", [False, True])
def test_next_step_is_dispatched_before_the_tokens_are_read(model_dir, prompts, pipelined):
    """Pipelined, each step's tokens are read from the device after the next step was dispatched (unless nothing
    was left to schedule), once, and that step's inputs name them as pending; serially, never."""
    llm = make_llm(model_dir, pipelined, max_num_seqs=4)
    events = instrument(llm)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:6]], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert_nothing_leaked(llm)
    llm.shutdown()

    dispatched = [e[1] for e in events if e[0] == "dispatch"]
    reads = [e[1] for e in events if e[0] == "read"]
    assert sorted(reads) == reads
    assert len(set(reads)) == len(reads) and set(reads) >= set(dispatched[:-1]), "each step is read once"
    overlapped = waited = 0
    for position, event in enumerate(events):
        if event[0] != "read":
            continue
        before = events[:position]
        next_dispatched = any(e[0] == "dispatch" and e[1] == event[1] + 1 for e in before)
        last_schedule_empty = [e for e in before if e[0] == "schedule"][-1][1]
        overlapped += next_dispatched
        waited += not next_dispatched and not last_schedule_empty
    with_pending = sum(e[2] for e in events if e[0] == "dispatch")
    if pipelined:
        assert waited == 0, f"the host waited for tokens while a step was ready to go: {events}"
        assert overlapped == with_pending > len(reads) // 2, events
    else:
        assert overlapped == 0 and with_pending == 0, events


def test_abort_while_a_step_is_in_flight(model_dir, prompts):
    """Aborted between steps with their next step already dispatched, requests emit nothing more and free their
    blocks once; the others finish with the serial engine's tokens."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = {}
    for pipelined in (False, True):
        config = EngineConfig.from_kwargs(str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=4,
                                          seed=0, async_scheduling=pipelined)
        core = build_engine(config).core
        for i, prompt in enumerate(prompts[:6]):
            core.add_request(Request(f"r{i}", prompt, params))
        tokens: dict[str, list[int]] = collections.defaultdict(list)
        aborted_at: dict[str, int] = {}
        while core.has_unfinished():
            for out in core.step():
                assert out.request_id not in aborted_at, f"{out.request_id} emitted after its abort"
                tokens[out.request_id] += out.new_token_ids
            if pipelined and len(tokens["r1"]) >= 3 and "r1" not in aborted_at:
                assert core._in_flight is not None, "a step should be in flight"
                abort_outputs = core.abort(["r1", "r5"])  # r1 running, r5 still waiting (4 slots)
                assert {o.request_id: o.finish_reason for o in abort_outputs} == {"r1": "abort", "r5": "abort"}
                aborted_at = {"r1": len(tokens["r1"]), "r5": len(tokens["r5"])}
        assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks
        core.kv_manager.check_invariants()
        results[pipelined] = tokens
    serial, pipelined = results[False], results[True]
    for request_id, reference in serial.items():
        if request_id == "r1":
            assert pipelined[request_id] == reference[: len(pipelined[request_id])] and 3 <= len(pipelined["r1"]) < 10
        elif request_id == "r5":
            assert pipelined.get(request_id, []) == []
        else:
            assert pipelined[request_id] == reference, f"{request_id} (seed {SEED})"


def test_a_reused_request_id_gets_nothing_of_the_earlier_request(model_dir, prompts):
    """An id aborted while a step holding it is in flight may come back at once: the new request's tokens are its
    own (what it generates alone), none of the earlier request's."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cores = {}
    for pipelined in (False, True):
        config = EngineConfig.from_kwargs(str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=4,
                                          seed=0, async_scheduling=pipelined)
        cores[pipelined] = build_engine(config).core
    alone = run_core(cores[False], [Request("x", prompts[1], params)])["x"]
    core = cores[True]
    core.add_request(Request("x", prompts[0], dataclasses.replace(params, max_tokens=20)))
    while core._in_flight is None or core.scheduler.requests["x"].num_output_tokens < 2:
        core.step()
    core.abort(["x"])
    assert core._in_flight is not None and "x" in core._in_flight[0].num_scheduled_tokens
    assert run_core(core, [Request("x", prompts[1], params)])["x"] == alone, f"seed {SEED}"
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def run_core(core, requests: list[Request]) -> dict[str, list[int]]:
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def test_pending_placeholders_resolve_to_each_rows_last_token():
    """The token feed against a plain numpy rule on random ids: a placeholder for row r becomes row r's token."""
    rng = np.random.default_rng(SEED)
    row_tokens = rng.integers(0, 1000, size=16).astype(np.int32)
    ids = rng.integers(-1, 1000, size=(5, 40)).astype(np.int32)  # -1: the samplers' padding stays as it is
    pending = rng.random(ids.shape) < 0.3
    rows = rng.integers(0, 16, size=ids.shape)
    ids = np.where(pending, pending_token_id(rows), ids)
    expected = np.where(pending, row_tokens[rows], ids)
    np.testing.assert_array_equal(np.asarray(resolve_pending(jnp.asarray(ids), jnp.asarray(row_tokens))), expected)
