"""Prompt lookup: the vectorised proposer equals a plain per-row search, and on a prompt whose continuation repeats
it, almost every draft is accepted."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from jengine import LLM, SamplingParams
from jengine.spec_decode.ngram import propose_ngram
from tests.spec_decode.conftest import COPY_CYCLE


def reference_lookup(tokens: list[int], lookup_min: int, lookup_max: int, k: int) -> list[int]:
    """The longest n-gram suffix (n from max down to min) found earlier; the tokens after its first occurrence."""
    for n in range(lookup_max, lookup_min - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=6),
       st.integers(1, 3), st.integers(0, 2), st.integers(1, 5))
def test_vectorised_lookup_matches_a_plain_search(histories, lookup_min, extra, k):
    width = max(map(len, histories)) + 4
    token_ids = np.full((len(histories), width), 99, np.int32)  # junk past each history must never be read
    for row, history in enumerate(histories):
        token_ids[row, : len(history)] = history
    lengths = np.array([len(h) for h in histories])
    got = propose_ngram(token_ids, lengths, lookup_min, lookup_min + extra, k)
    assert got == [reference_lookup(h, lookup_min, lookup_min + extra, k) for h in histories]


def test_ngram_acceptance_on_a_repeating_continuation(copying_model):
    model_dir, cycle = copying_model
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, seed=0, speculative_config=config)
    out = llm.generate([{"prompt_token_ids": cycle * 3}], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert out == (cycle * 6)[:40], "the copying model should continue its cycle"
    counts = llm._core.scheduler.spec_counts
    assert counts.acceptance_rate > 0.8, counts
    assert counts.num_drafts < 40 // 2, "verification should emit several tokens per step"
    assert len(cycle) == COPY_CYCLE
    llm.shutdown()
