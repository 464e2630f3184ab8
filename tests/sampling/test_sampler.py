"""The jitted sampler against hand-built distributions and numpy references, called the way the runner calls it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.layers.invariant import RowReduction
from jengine.sampling.metadata import RowInputs, SamplingMetadata, build_sampling_metadata
from jengine.sampling.params import SamplingParams
from jengine.sampling.sampler import SamplerOutput, apply_logits_processors, raw_logprobs, row_keys, sample

SAMPLE = jax.jit(sample)
PROCESS = jax.jit(apply_logits_processors)
PROBS = np.array([0.5, 0.3, 0.15, 0.05])


def make_row(
    params: SamplingParams | None = None, *, prompt: Sequence[int] = (), output: Sequence[int] = (),
    choice: int = 0, counter: int = 0, eos: tuple[int, ...] = (),
) -> RowInputs:
    return RowInputs(params or SamplingParams(), list(prompt), list(output), len(output), choice, counter, eos)


def run(logits: np.ndarray, rows: Sequence[RowInputs], num_rows: int | None = None, **kw: int) -> SamplerOutput:
    num_rows = num_rows or len(rows)
    padded = np.zeros((num_rows, logits.shape[1]), np.float32)
    padded[: len(logits)] = logits
    md = build_sampling_metadata(rows, num_rows, **kw)
    return jax.device_get(SAMPLE(jnp.asarray(padded), md))


def hand_built_logits(vocab: int) -> np.ndarray:
    """log(PROBS) followed by impossible tokens, so a larger vocabulary takes the lax.top_k candidate path."""
    logits = np.full(vocab, -np.inf, np.float32)
    logits[:4] = np.log(PROBS)
    return logits


def draw(params: SamplingParams, logits: np.ndarray, num_rows: int = 256, steps: int = 4) -> np.ndarray:
    """num_rows × steps draws: every row its own seed, every step its own key."""
    tokens = []
    for step in range(steps):
        rows = [
            RowInputs(dataclasses.replace(params, seed=seed), [], [0] * step, step) for seed in range(num_rows)
        ]
        tokens.append(run(np.tile(logits, (num_rows, 1)), rows).token_ids)
    return np.concatenate(tokens)


# --- greedy -----------------------------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = np.random.default_rng(0).normal(size=(5, 300)).astype(np.float32)
    out = run(logits, [make_row(SamplingParams(temperature=0))] * 5, num_rows=8)
    np.testing.assert_array_equal(out.token_ids[:5], logits.argmax(-1))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_rank is None


def test_greedy_rows_in_a_sampling_batch_are_argmax() -> None:
    logits = np.random.default_rng(1).normal(size=(6, 300)).astype(np.float32)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=3, top_p=0.5, min_p=0.1, seed=1)] * 3
    out = run(logits, [make_row(p) for p in params])
    np.testing.assert_array_equal(out.token_ids[::2], logits[::2].argmax(-1))


# --- support of the filters -------------------------------------------------------------------------------------


SUPPORT_CASES = [
    (dict(), {0, 1, 2, 3}),
    (dict(top_p=0.8), {0, 1}),
    (dict(top_p=0.81), {0, 1, 2}),
    (dict(top_p=0.5), {0}),
    (dict(top_p=0.96), {0, 1, 2, 3}),
    (dict(top_p=1e-4), {0}),
    (dict(min_p=0.2), {0, 1, 2}),
    (dict(min_p=0.7), {0}),
    (dict(top_k=1), {0}),
    (dict(top_k=2), {0, 1}),
    (dict(top_k=3, top_p=0.6), {0, 1}),  # top-p over the renormalised top 3: 0.53, 0.32, 0.16
    (dict(top_k=3, min_p=0.35), {0, 1}),
    (dict(temperature=0.5, min_p=0.2), {0, 1}),  # sharpened: p² ∝ 1, 0.36, 0.09, 0.01 of the max
    (dict(temperature=2.0, top_p=0.85), {0, 1, 2}),  # flattened: √p normalised ≈ 0.38, 0.29, 0.21, 0.12
]


@pytest.mark.parametrize(
    ("vocab", "only_top_k"),
    [(4, False), (128, False), (128, True)],  # 128 with top-k rows only: the lax.top_k candidate path
)
def test_filters_keep_exactly_the_expected_support(vocab: int, only_top_k: bool) -> None:
    """All cases in one mixed batch (rows must not see each other), 64 seeds × 4 steps per case."""
    cases = [(k, v) for k, v in SUPPORT_CASES if "top_k" in k or not only_top_k]
    seeds = 64
    rows_per_step = [
        [RowInputs(SamplingParams(**kwargs, seed=s), [], [0] * step, step) for kwargs, _ in cases for s in range(seeds)]
        for step in range(4)
    ]
    md = build_sampling_metadata(rows_per_step[0], len(rows_per_step[0]))
    assert (0 < md.max_top_k < vocab) == only_top_k
    logits = np.tile(hand_built_logits(vocab), (len(rows_per_step[0]), 1))
    tokens = np.stack([run(logits, rows).token_ids for rows in rows_per_step], axis=1)
    for i, (kwargs, support) in enumerate(cases):
        assert set(tokens[i * seeds : (i + 1) * seeds].ravel().tolist()) == support, kwargs


@pytest.mark.parametrize("vocab", [4, 700])
def test_deterministic_top_p_keeps_the_same_tokens(vocab: int) -> None:
    """`--deterministic`'s top-p (the row kernel's softmax, an associative-scan prefix sum; Pallas interpret mode)
    draws exactly the default sampler's tokens: on the hand-built cases, every seed, and on random logits whose
    top-p cut falls anywhere (its float32 prefix sums within rounding of cumsum's)."""
    rng = np.random.default_rng(vocab)
    cases = [kwargs for kwargs, _ in SUPPORT_CASES]
    rows = [RowInputs(SamplingParams(**kwargs, seed=s), [], [], 0) for kwargs in cases for s in range(16)]
    logits = np.tile(hand_built_logits(vocab), (len(rows), 1))
    if vocab > 4:
        rows += [RowInputs(SamplingParams(top_p=float(p), seed=i), [], [], 0)
                 for i, p in enumerate(rng.uniform(0.2, 0.95, 32))]
        logits = np.concatenate([logits, (rng.normal(size=(32, vocab)) * 3).astype(np.float32)])
    md = build_sampling_metadata(rows, len(rows))
    deterministic = dataclasses.replace(md, row_reduction=RowReduction("pallas_interpret"))
    fast = SAMPLE(jnp.asarray(logits), md).token_ids
    ours = SAMPLE(jnp.asarray(logits), deterministic).token_ids
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(fast))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_frequencies_follow_the_tempered_distribution(temperature: float) -> None:
    tokens = draw(SamplingParams(temperature=temperature), hand_built_logits(4), num_rows=1024, steps=4)
    expected = PROBS ** (1 / temperature) / np.sum(PROBS ** (1 / temperature))
    np.testing.assert_allclose(np.bincount(tokens, minlength=4) / tokens.size, expected, atol=0.03)


def test_candidate_path_matches_full_sort() -> None:
    """lax.top_k over a bucket of candidates and a full sort give the same tokens."""
    rng = np.random.default_rng(2)
    logits = (rng.normal(size=(16, 500)) * 2).astype(np.float32)
    params = [SamplingParams(top_k=int(k), top_p=float(p), seed=i) for i, (k, p) in
              enumerate(zip(rng.integers(1, 60, 16), rng.uniform(0.3, 1.0, 16)))]
    md = build_sampling_metadata([make_row(p) for p in params], 16)
    assert md.max_top_k == 64
    full = dataclasses.replace(md, max_top_k=0)
    np.testing.assert_array_equal(SAMPLE(logits, md).token_ids, SAMPLE(logits, full).token_ids)


# --- per-request randomness -------------------------------------------------------------------------------------


def test_seeded_row_is_the_same_alone_or_in_a_batch() -> None:
    rng = np.random.default_rng(3)
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    others = [
        SamplingParams(temperature=0), SamplingParams(top_k=5, seed=7), SamplingParams(logprobs=3),
        SamplingParams(min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=1.5, logit_bias={3: 5.0}, min_tokens=2, stop_token_ids=[4]),
    ]
    alone: list[int] = []
    batched: list[int] = []
    for _ in range(6):
        logits = (rng.normal(size=(6, 64)) * 2).astype(np.float32)
        alone.append(int(run(logits[3:4], [make_row(target, output=alone)]).token_ids[0]))
        rows = [make_row(p, prompt=[1, 2], output=[5] * len(batched), counter=i) for i, p in enumerate(others)]
        rows.insert(3, make_row(target, output=batched))
        batched.append(int(run(logits, rows, num_rows=8).token_ids[3]))
    assert alone == batched
    assert len(set(alone)) > 1


def sequences(rows_for_step, steps: int = 4, vocab: int = 1000, engine_seed: int = 0) -> list[tuple[int, ...]]:
    """Token sequences of each row over `steps` steps from uniform logits (each sequence is a seed fingerprint)."""
    num_rows = len(rows_for_step(0))
    tokens = [run(np.zeros((num_rows, vocab), np.float32), rows_for_step(s), engine_seed=engine_seed).token_ids
              for s in range(steps)]
    return [tuple(int(t) for t in column) for column in np.stack(tokens, axis=1)]


def test_different_seeds_and_choices_differ_and_repeat() -> None:
    by_seed = sequences(lambda s: [RowInputs(SamplingParams(seed=seed), [], [], s) for seed in range(8)])
    by_choice = sequences(lambda s: [RowInputs(SamplingParams(seed=5), [], [], s, choice_index=c) for c in range(8)])
    assert len(set(by_seed)) == 8 and len(set(by_choice)) == 8
    assert by_seed[5] == by_choice[0]  # choice 0 of seed 5 is seed 5
    assert by_seed == sequences(lambda s: [RowInputs(SamplingParams(seed=seed), [], [], s) for seed in range(8)])
    engine_seed_ignored = sequences(lambda s: [RowInputs(SamplingParams(seed=seed), [], [], s) for seed in range(8)],
                                    engine_seed=99)
    assert by_seed == engine_seed_ignored


def test_unseeded_rows_follow_engine_seed_and_counter() -> None:
    def rows(s: int) -> list[RowInputs]:
        return [RowInputs(SamplingParams(), [], [], s, request_counter=c) for c in range(8)]

    first = sequences(rows)
    assert len(set(first)) == 8
    assert first == sequences(rows)
    other_engine = sequences(rows, engine_seed=1)
    assert all(a != b for a, b in zip(first, other_engine))


def test_row_keys_are_folded_from_the_seed() -> None:
    rows = [RowInputs(SamplingParams(seed=42), [], [], 7, choice_index=2),
            RowInputs(SamplingParams(seed=2**40 + 3), [], [], 0)]
    md = build_sampling_metadata(rows, 2)
    np.testing.assert_array_equal(md.rng_key[0], jax.random.key_data(jax.random.PRNGKey(42)))
    np.testing.assert_array_equal(md.rng_key[1], [2**8, 3])
    expected = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(42), 2), 7)
    np.testing.assert_array_equal(jax.random.key_data(row_keys(md))[0], expected)


# --- logits processors ------------------------------------------------------------------------------------------


def numpy_penalties(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams) -> np.ndarray:
    """OpenAI/vLLM: repetition over prompt ∪ output, then frequency × count and presence × [count > 0] on output."""
    out = logits.astype(np.float64).copy()
    for token in set(prompt) | set(output):
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=len(logits))
    return out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def test_penalties_match_the_definition() -> None:
    logits = np.random.default_rng(4).normal(size=(4, 12)).astype(np.float32) * 3
    cases = [
        (SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3), [1, 2, 2], [2, 3, 3, 5]),
        (SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=-1.0), [0, 9], [9, 9, 9, 4]),
        (SamplingParams(frequency_penalty=2.0), list(range(12)), [7, 7, 7, 7, 7, 1]),
        (SamplingParams(), [1, 2], [3, 4]),
    ]
    md = build_sampling_metadata([make_row(p, prompt=pr, output=o) for p, pr, o in cases], 4)
    assert md.use_penalties and md.output_token_ids.shape[1] == 8
    got = np.asarray(PROCESS(logits, md))
    expected = np.stack([numpy_penalties(logits[i], pr, o, p) for i, (p, pr, o) in enumerate(cases)])
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_logit_bias_is_added() -> None:
    logits = np.random.default_rng(5).normal(size=(2, 10)).astype(np.float32)
    bias = {"7": 100.0, 2: -3.5}
    md = build_sampling_metadata([make_row(SamplingParams(temperature=0, logit_bias=bias)), make_row()], 2)
    expected = logits.copy()
    expected[0, 7] += 100.0
    expected[0, 2] -= 3.5
    np.testing.assert_allclose(np.asarray(PROCESS(logits, md)), expected, atol=1e-6)
    assert int(SAMPLE(logits, md).token_ids[0]) == 7


def test_logit_bias_restricts_sampling() -> None:
    only = SamplingParams(logit_bias={t: -100.0 for t in range(8) if t != 6})
    assert set(draw(only, np.zeros(8, np.float32), num_rows=64, steps=2).tolist()) == {6}


def test_banned_until_min_tokens() -> None:
    logits = np.zeros(16, np.float32)
    logits[[0, 1]] = 8.0  # EOS (0) and a stop id (1) dominate
    params = SamplingParams(min_tokens=3, stop_token_ids=[1])
    for step in range(3):
        rows = [RowInputs(dataclasses.replace(params, seed=s), [], [5] * step, step, eos_token_ids=(0,))
                for s in range(128)]
        assert not {0, 1} & set(run(np.tile(logits, (128, 1)), rows).token_ids.tolist())
    greedy = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[1])
    assert run(logits[None], [RowInputs(greedy, [], [], 2, eos_token_ids=(0,))]).token_ids[0] not in (0, 1)
    assert run(logits[None], [RowInputs(greedy, [], [], 3, eos_token_ids=(0,))]).token_ids[0] in (0, 1)
    ignore = dataclasses.replace(params, ignore_eos=True)
    md = build_sampling_metadata([RowInputs(ignore, [], [], 0, eos_token_ids=(0,))], 1)
    assert md.banned_token_ids[0].tolist() == [1] + [-1] * 7


# --- logprobs ---------------------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    rng = np.random.default_rng(6)
    logits = (rng.normal(size=(6, 50)) * 2).astype(np.float32)
    params = [
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0, logprobs=5, logit_bias={3: 50.0}),
        SamplingParams(temperature=3.0, logprobs=2, seed=1),
        SamplingParams(top_k=4, logprobs=1, repetition_penalty=2.0, frequency_penalty=1.0, seed=2),
        SamplingParams(temperature=5.0, logprobs=5, seed=3),
        SamplingParams(),
    ]
    out = run(logits, [make_row(p, prompt=[0, 1], output=[2, 2]) for p in params], num_rows=8)
    assert out.logprobs.shape == (8, 9) and out.logprob_token_ids.shape == (8, 9)  # K bucketed from 5 to 8
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    ref = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    rows = np.arange(6)
    tokens = out.token_ids[:6]
    assert tokens[1] == 3
    np.testing.assert_array_equal(out.logprob_token_ids[:6, 0], tokens)
    np.testing.assert_allclose(out.logprobs[:6, 0], ref[rows, tokens], atol=1e-5)
    top_ids = np.argsort(-ref, axis=-1)[:, :8]
    np.testing.assert_array_equal(out.logprob_token_ids[:6, 1:], top_ids)
    np.testing.assert_allclose(out.logprobs[:6, 1:], np.take_along_axis(ref, top_ids, 1), atol=1e-5)
    np.testing.assert_array_equal(out.sampled_rank[:6], (ref > ref[rows, tokens][:, None]).sum(-1) + 1)
    assert out.sampled_rank[1] > 1  # the bias moved the choice, not the reported distribution


# --- bucketing --------------------------------------------------------------------------------------------------


def test_builder_pads_with_greedy_rows_and_power_of_two_widths() -> None:
    rows = [make_row(SamplingParams(top_k=5, top_p=0.9, min_p=0.1, temperature=0.7, frequency_penalty=0.1,
                                    logit_bias={1: 1.0, 2: 2.0, 3: 3.0}), output=list(range(9)))]
    md = build_sampling_metadata(rows, 4)
    assert md.num_rows == 4 and not md.all_greedy and md.use_top_k and md.use_top_p and md.use_min_p
    np.testing.assert_array_equal(md.temperature[1:], 0)
    np.testing.assert_array_equal(md.top_k[1:], 0)
    np.testing.assert_array_equal(md.top_p[1:], 1)
    np.testing.assert_array_equal(md.repetition_penalty[1:], 1)
    assert md.output_token_ids.shape == (4, 16) and md.prompt_token_ids.shape == (4, 0)
    assert md.logit_bias_ids.shape == (4, 8) and md.banned_token_ids.shape == (4, 0)
    assert (md.output_token_ids[1:] == -1).all() and (md.logit_bias_ids[1:] == -1).all()
    with pytest.raises(ValueError):
        build_sampling_metadata(rows * 3, 2)


def test_same_buckets_do_not_recompile() -> None:
    traces: list[SamplingMetadata] = []

    def traced(logits: jax.Array, md: SamplingMetadata) -> SamplerOutput:
        traces.append(md)
        return sample(logits, md)

    step = jax.jit(traced)
    logits = np.zeros((8, 32), np.float32)
    for i, n in enumerate([2, 5, 8]):
        rows = [make_row(SamplingParams(temperature=0.5 + j / 10, top_k=3 + j, seed=j + i, presence_penalty=0.1),
                         output=[1] * (9 + (j + i) % 8)) for j in range(n)]  # width 16
        step(logits, build_sampling_metadata(rows, 8)).token_ids.block_until_ready()
    assert len(traces) == 1


def test_raw_logprobs_of_given_tokens() -> None:
    """The runner reuses raw_logprobs for prompt logprobs: given targets, their values and ranks, and the top-K."""
    logits = np.random.default_rng(7).normal(size=(5, 40)).astype(np.float32)
    targets = np.array([0, 7, 39, 3, 3], np.int32)
    out = jax.device_get(jax.jit(raw_logprobs, static_argnums=2)(targets, logits, 4))
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprobs[:, 0], ref[np.arange(5), targets], atol=1e-5)
    np.testing.assert_array_equal(out.logprob_token_ids[:, 1:], np.argsort(-ref, axis=-1)[:, :4])
    np.testing.assert_array_equal(out.sampled_rank, (ref > ref[np.arange(5), targets][:, None]).sum(-1) + 1)
