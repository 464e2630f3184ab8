"""Rejection sampling keeps the target's distribution exactly: over many seeded trials on a tiny vocabulary, the
tokens emitted after verifying drafts follow the target's temperature/top-p distribution (chi-square test at
significance 0.001), whatever the draft; greedy rows accept exactly the argmax."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jengine.sampling.metadata import RowInputs, build_sampling_metadata
from jengine.sampling.params import SamplingParams
from jengine.spec_decode.rejection import verify

VOCAB = 6
TRIALS = 12000
# chi2.ppf(0.999, df) for df = 1..7
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def target_distribution(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """float64 reference: softmax(logits / T), restricted to the smallest descending prefix reaching top_p."""
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(VOCAB, bool)
    keep[order[before < top_p]] = True
    probs = np.where(keep, probs, 0)
    return probs / probs.sum()


def chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> tuple[float, int]:
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    expected = expected_probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def run_trials(logits: np.ndarray, drafts: list[int], params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """TRIALS verifications of `drafts` (k of them, k + 1 rows each, trial i seeded i): (emitted, num accepted)."""
    k = len(drafts)
    rows = [RowInputs(dataclasses.replace(params, seed=trial), (), (), generation_step=j)
            for trial in range(TRIALS) for j in range(k + 1)]
    md = build_sampling_metadata(rows, len(rows))
    draft_ids = np.tile(np.array(drafts + [-1], np.int32), TRIALS)
    out = verify(np.tile(logits, (TRIALS * (k + 1), 1)).astype(np.float32), md, draft_ids)
    accepted = np.asarray(out.accepted).reshape(TRIALS, k + 1)
    candidates = np.asarray(out.candidates).reshape(TRIALS, k + 1)
    num_accepted = np.argmin(accepted, axis=1)  # the bonus row never accepts
    emitted = np.where(accepted, draft_ids.reshape(TRIALS, k + 1), candidates)
    return emitted, num_accepted


LOGITS = np.array([1.2, 0.4, -0.3, 0.9, -1.5, 0.1])
PARAMS = SamplingParams(temperature=0.8, top_p=0.85)


@pytest.mark.parametrize("drafts", [[0, 3], [4, 0], [1, 1]], ids=["likely", "filtered-out", "mid"])
def test_emitted_tokens_follow_the_target_distribution(drafts):
    expected = target_distribution(LOGITS, PARAMS.temperature, PARAMS.top_p)
    emitted, num_accepted = run_trials(LOGITS, drafts, PARAMS)
    statistic, df = chi_square(np.bincount(emitted[:, 0], minlength=VOCAB), expected)
    assert statistic < CHI2_CRITICAL_0_001[df], f"first token: chi2 {statistic:.1f} with {df} dof"
    second = emitted[num_accepted >= 1, 1]  # the first draft accepted: the next token is drawn at position 1
    if len(second) > 500:
        statistic, df = chi_square(np.bincount(second, minlength=VOCAB), expected)
        assert statistic < CHI2_CRITICAL_0_001[df], f"second token: chi2 {statistic:.1f} with {df} dof"
    rate, p = (num_accepted >= 1).mean(), expected[drafts[0]]
    assert abs(rate - p) <= 4.5 * np.sqrt(max(p * (1 - p), 1e-12) / TRIALS) + 1e-9, "acceptance is not p(draft)"


def test_greedy_rows_accept_exactly_the_argmax():
    md = build_sampling_metadata([RowInputs(SamplingParams(temperature=0), (), (), generation_step=j)
                                  for j in range(3)], 3)
    logits = np.tile(LOGITS.astype(np.float32), (3, 1))
    out = verify(logits, md, np.array([0, 3, -1], np.int32))
    assert np.asarray(out.accepted).tolist() == [True, False, False]
    assert np.asarray(out.candidates).tolist() == [0, 0, 0]
