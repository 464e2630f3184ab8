"""Speculation through `LLM`: seeded sampling stays batch-independent, requests whose options speculation cannot
honour decode plainly beside speculating ones, `disable_by_batch_size` switches it off, and the configuration is
checked (vLLM's JSON; EAGLE methods need a head directory)."""

from __future__ import annotations

import re

import pytest

from jengine import LLM, SamplingParams, StructuredOutputsParams
from jengine.config import EngineConfig
from jengine.errors import ConfigError

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def build(model_dir, **engine_args) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_model_len=128, seed=0, **engine_args)


def prompt(cycle: list[int]) -> dict:
    return {"prompt_token_ids": cycle * 2}


def test_seeded_sampling_with_speculation_is_batch_independent(copying_model):
    """Speculation at temperature > 0 (with top-p, top-k, min-p and penalties): a seeded request's tokens are the
    same alone and beside other requests."""
    model_dir, cycle = copying_model
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.01, presence_penalty=0.2,
                            frequency_penalty=0.1, repetition_penalty=1.1, seed=7, max_tokens=16, ignore_eos=True)
    llm = build(model_dir, speculative_config=NGRAM)
    alone = llm.generate([prompt(cycle)], params, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    batch = llm.generate([prompt(cycle)] * 3, [params, other, other], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    assert llm._core.scheduler.spec_counts.num_accepted_tokens > 0
    assert llm._core.kv_manager.num_free_blocks == llm._core.kv_manager.num_blocks
    llm.shutdown()


def test_penalties_see_the_drafts_before_each_position(copying_model):
    """Greedy with penalties and min_tokens: each verified position's penalties count the drafts before it, so the
    tokens equal the plain engine's even where the penalties turn the copying model away from its cycle."""
    model_dir, cycle = copying_model
    params = SamplingParams(temperature=0, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3,
                            min_tokens=20, max_tokens=30, stop_token_ids=[cycle[3]])
    plain = build(model_dir)
    expected = plain.generate([prompt(cycle)], params, use_tqdm=False)[0].outputs[0].token_ids
    plain.shutdown()
    llm = build(model_dir, speculative_config=NGRAM)
    assert llm.generate([prompt(cycle)], params, use_tqdm=False)[0].outputs[0].token_ids == expected
    counts = llm._core.scheduler.spec_counts
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens, "expected some drafts accepted, some not"
    llm.shutdown()


def test_logprob_requests_decode_plainly_beside_speculating_ones(copying_model):
    model_dir, cycle = copying_model
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = build(model_dir)
    expected = plain.generate([prompt(cycle)], greedy.clone(logprobs=2), use_tqdm=False)[0].outputs[0]
    plain.shutdown()
    llm = build(model_dir, speculative_config=NGRAM)
    with_logprobs, speculating = llm.generate([prompt(cycle)] * 2, [greedy.clone(logprobs=2), greedy],
                                              use_tqdm=False)
    assert with_logprobs.outputs[0].token_ids == speculating.outputs[0].token_ids == expected.token_ids
    assert len(with_logprobs.outputs[0].logprobs) == 12
    for got, want in zip(with_logprobs.outputs[0].logprobs, expected.logprobs):
        assert got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-5 for t in got)
    assert llm._core.scheduler.spec_counts.num_drafts < 12, "only the request without logprobs speculates"
    llm.shutdown()


def test_disable_by_batch_size(copying_model):
    model_dir, cycle = copying_model
    llm = build(model_dir, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    llm.generate([prompt(cycle)] * 3, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert llm._core.scheduler.spec_counts.num_drafts == 0, "three running requests: above the limit"
    llm.generate([prompt(cycle)] * 2, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert llm._core.scheduler.spec_counts.num_drafts > 0
    llm.shutdown()


def test_configuration():
    config = EngineConfig.from_kwargs("m", speculative_config='{"method": "ngram", "num_speculative_tokens": 5}')
    assert config.speculative.num_speculative_tokens == 5 and config.speculative.lookup_max == 5
    for method in ("eagle", "eagle3"):
        with pytest.raises(ConfigError, match=f"{method} needs the head's directory"):
            EngineConfig.from_kwargs("m", speculative_config={"method": method, "num_speculative_tokens": 3})
    eagle3 = EngineConfig.from_kwargs("m", speculative_config={
        "method": "eagle3", "model": "x", "num_speculative_tokens": 3, "eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    assert eagle3.speculative.eagle_aux_hidden_state_layer_ids == (0, 1, 2)
    with pytest.raises(ConfigError, match="unknown speculative_config field"):
        EngineConfig.from_kwargs("m", speculative_config={"method": "ngram", "num_speculative_tokens": 3, "k": 1})
    with pytest.raises(ConfigError, match="needs the draft's directory"):
        EngineConfig.from_kwargs("m", speculative_config={"method": "draft_model", "num_speculative_tokens": 3})
    assert EngineConfig.from_kwargs("m", speculative_config=None).speculative is None


def test_draft_model_up_to_the_context_limit(dense_target, small_draft):
    """Proposals near max_model_len write past the request's blocks (scratch); the output ends at the limit and
    equals the plain engine's."""
    prompt_ids = {"prompt_token_ids": list(range(5, 55))}
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    engine_args = dict(dtype="float32", max_model_len=64, seed=0)
    plain = LLM(str(dense_target), **engine_args)
    expected = plain.generate([prompt_ids], params, use_tqdm=False)[0].outputs[0]
    plain.shutdown()
    llm = LLM(str(dense_target), **engine_args,
              speculative_config={"method": "draft_model", "model": str(small_draft), "num_speculative_tokens": 5})
    got = llm.generate([prompt_ids], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids and len(got.token_ids) == 14 and got.finish_reason == "length"
    assert llm._core.kv_manager.num_free_blocks == llm._core.kv_manager.num_blocks
    llm.shutdown()


def test_prompt_logprobs_beside_a_speculating_request(copying_model):
    """A chunked prefill asking for prompt logprobs shares verification steps with a speculating request: its
    prompt logprobs and both outputs equal the plain engine's."""
    model_dir, cycle = copying_model
    long_prompt = {"prompt_token_ids": list(range(40, 100))}
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)]

    def run(**engine_args):
        llm = build(model_dir, max_num_batched_tokens=16, **engine_args)
        outputs = llm.generate([prompt(cycle), long_prompt], params, use_tqdm=False)
        counts = llm._core.scheduler.spec_counts
        llm.shutdown()
        return outputs, counts

    plain, _ = run()
    speculative, counts = run(speculative_config=NGRAM)
    assert counts.num_accepted_tokens > 0
    for got, want in zip(speculative, plain):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    got_lp, want_lp = speculative[1].prompt_logprobs, plain[1].prompt_logprobs
    assert len(got_lp) == len(want_lp) == 60 and got_lp[0] is None
    for got, want in zip(got_lp[1:], want_lp[1:]):
        assert got.keys() == want.keys() and all(abs(got[t].logprob - want[t].logprob) < 1e-5 for t in got)


def test_prompt_lookup_pipelines_steps_while_it_finds_nothing(dense_target):
    """With nothing to propose the engine keeps dispatching a step before the previous one's tokens arrive; its
    tokens are the plain engine's."""
    from jengine.request import Request

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt_ids = list(range(10, 40))
    plain = build(dense_target)
    expected = plain.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0].outputs[0].token_ids
    plain.shutdown()
    llm = build(dense_target, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_min": 6})
    core = llm._core
    core.add_request(Request("a", prompt_ids, params))
    tokens, overlapped = [], 0
    while core.has_unfinished():
        tokens += [t for out in core.step() for t in out.new_token_ids]
        overlapped += core._in_flight is not None
    assert tokens == expected and overlapped >= 3
    llm.shutdown()


def test_structured_output_request_beside_a_speculating_one(copying_model):
    """A constrained request decodes plainly (its mask reaches its row of each verification step) while another
    speculates: both outputs equal the plain engine's."""
    model_dir, cycle = copying_model
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2,4}x"))]

    def run(**engine_args):
        llm = build(model_dir, **engine_args)
        outputs = llm.generate([prompt(cycle), prompt(cycle)], params, use_tqdm=False)
        counts = llm._core.scheduler.spec_counts
        llm.shutdown()
        return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outputs], counts

    plain, _ = run()
    speculative, counts = run(speculative_config=NGRAM)
    assert speculative == plain and counts.num_accepted_tokens > 0
    assert re.fullmatch(r"[0-9]{2,4}x", speculative[1][1])
