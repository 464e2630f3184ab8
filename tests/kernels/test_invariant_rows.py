"""The batch-invariant row reductions (`pallas_kernels/invariant_matmul/rows.py`, interpret mode): RMSNorm and
log-sum-exp against float64 numpy on ragged widths, rows of -inf, a row bit for bit the same alone and in batches,
and the Triton lowering for an H200 of an 8B hidden state and a 128k vocabulary. The fused residual add and RMSNorm
bit for bit the unfused path's (the add, then the RMSNorm kernel), and both its outputs against float64. Tolerances:
float32 1e-6 relative; bfloat16 RMSNorm two bf16 roundings (the normed value, then the output: 2^-7 relative); the
bfloat16 sum one rounding (2^-8 relative), its normed rows a third (2^-7 + 2^-8)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.invariant_matmul.rows import (add_rms_norm_rows, log_softmax_rows, logsumexp_rows,
                                                  rms_norm_pair_rows, rms_norm_rows)
from tests.conftest import fresh_seed

SEED = fresh_seed()


def rms_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x, w = x.astype(np.float64), w.astype(np.float64)
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2 ** -7)])
@pytest.mark.parametrize("shape", [(3, 64), (5, 2880), (2, 4, 128), (2, 8500)])  # 8,500: past the unrolled rows
def test_rms_norm_matches_float64(shape, dtype, tol):
    rng = np.random.default_rng(sum(shape))
    x = jnp.asarray(rng.normal(0, 3, shape), dtype)
    w = jnp.asarray(rng.normal(1, 0.5, shape[-1]), dtype)
    ours = rms_norm_rows(x, w, eps=1e-6, interpret=True)
    assert ours.shape == x.shape and ours.dtype == dtype
    ref = rms_reference(np.asarray(x.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)), 1e-6)
    err = np.abs(np.asarray(ours.astype(jnp.float32)) - ref)
    assert np.all(err <= tol * np.abs(ref) + 1e-6 * np.abs(ref).max())


def bits(a) -> np.ndarray:
    """The array's bit patterns (so -0 differs from 0 and NaN equals itself)."""
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(1, 64), (3, 1024), (7, 2880), (2, 5, 4096)])
def test_add_rms_norm_is_bitwise_the_add_then_the_norm(shape, dtype):
    rng = np.random.default_rng([SEED, *shape])  # fresh inputs each run: bitwise equality must hold for any
    x, delta = (jnp.asarray(rng.normal(0, 3, shape), dtype) for _ in range(2))
    w = jnp.asarray(rng.normal(1, 0.5, shape[-1]), dtype)
    total, normed = add_rms_norm_rows(x, delta, w, eps=1e-6, interpret=True)
    unfused = x + delta
    assert total.shape == normed.shape == x.shape and total.dtype == normed.dtype == dtype
    assert np.array_equal(bits(total), bits(unfused)), f"seed {SEED}"
    assert np.array_equal(bits(normed), bits(rms_norm_rows(unfused, w, eps=1e-6, interpret=True))), f"seed {SEED}"


@pytest.mark.parametrize("width", [700, 4096, 5000, 8192])
def test_rows_in_straight_line_code_are_bitwise_the_loop(width):
    """A row walked unrolled (its chunks all loaded at once) gives the loop's bits, fused add or not."""
    rng = np.random.default_rng([SEED, width])
    x, delta = (jnp.asarray(rng.normal(0, 3, (3, width)), jnp.bfloat16) for _ in range(2))
    w = jnp.asarray(rng.normal(1, 0.5, width), jnp.bfloat16)
    for walk in (lambda **kw: (rms_norm_rows(x, w, eps=1e-6, interpret=True, **kw),),
                 lambda **kw: add_rms_norm_rows(x, delta, w, eps=1e-6, interpret=True, **kw)):
        for got, want in zip(walk(), walk(max_unrolled_chunks=0), strict=True):
            assert np.array_equal(bits(got), bits(want)), f"seed {SEED}"


@pytest.mark.parametrize("dtype,sum_tol,tol", [(jnp.float32, 1e-7, 1e-6), (jnp.bfloat16, 2 ** -8, 2 ** -7 + 2 ** -8)])
def test_add_rms_norm_matches_float64(dtype, sum_tol, tol):
    rng = np.random.default_rng(5)
    x, delta = (jnp.asarray(rng.normal(0, 3, (6, 2500)), dtype) for _ in range(2))
    w = jnp.asarray(rng.normal(1, 0.5, 2500), dtype)
    total, normed = add_rms_norm_rows(x, delta, w, eps=1e-5, interpret=True)
    exact = sum(np.asarray(a.astype(jnp.float32), np.float64) for a in (x, delta))
    np.testing.assert_allclose(np.asarray(total.astype(jnp.float32)), exact, rtol=sum_tol, atol=0)
    ref = rms_reference(exact, np.asarray(w.astype(jnp.float32)), 1e-5)
    err = np.abs(np.asarray(normed.astype(jnp.float32)) - ref)
    assert np.all(err <= tol * np.abs(ref) + 1e-6 * np.abs(ref).max())


def test_logsumexp_matches_float64_with_masked_rows():
    rng = np.random.default_rng(3)
    x = (rng.normal(0, 4, (4, 3000))).astype(np.float32)
    x[1] = -np.inf  # every token banned
    x[2, :2500] = -np.inf  # the first chunks banned: their slots must not turn into NaN
    ours = np.asarray(logsumexp_rows(jnp.asarray(x), interpret=True))
    finite = np.isfinite(x.max(-1))
    top = np.where(finite, x.max(-1), 0)
    ref = np.where(finite, top + np.log(np.exp(x.astype(np.float64) - top[:, None]).sum(-1)), -np.inf)
    assert ours[1] == -np.inf
    np.testing.assert_allclose(ours[finite], ref[finite], rtol=1e-6)
    softmax = np.exp(np.asarray(log_softmax_rows(jnp.asarray(x[finite]), interpret=True)).astype(np.float64))
    np.testing.assert_allclose(softmax.sum(-1), 1.0, rtol=1e-5)


def test_a_row_is_the_same_alone_and_in_any_batch():
    rng = np.random.default_rng(11)
    d, v = 1500, 2500
    row = rng.normal(0, 2, (1, d)).astype(np.float32)
    logits = rng.normal(0, 4, (1, v)).astype(np.float32)
    w = jnp.asarray(rng.normal(1, 0.3, d).astype(np.float32))
    norm_alone = np.asarray(rms_norm_rows(jnp.asarray(row), w, eps=1e-5, interpret=True))[0]
    lse_alone = np.asarray(logsumexp_rows(jnp.asarray(logits), interpret=True))[0]
    for m, at in ((4, 2), (33, 32)):
        batch, vocab = rng.normal(0, 2, (m, d)).astype(np.float32), rng.normal(0, 4, (m, v)).astype(np.float32)
        batch[at], vocab[at] = row[0], logits[0]
        assert np.array_equal(np.asarray(rms_norm_rows(jnp.asarray(batch), w, eps=1e-5, interpret=True))[at],
                              norm_alone)
        assert np.asarray(logsumexp_rows(jnp.asarray(vocab), interpret=True))[at] == lse_alone


@pytest.mark.parametrize("kind", ["rms_norm", "logsumexp"])
def test_lowers_for_h200(kind):
    from tests.kernels.test_lowering import S, lower_for_h200

    if kind == "rms_norm":
        text = lower_for_h200(lambda x, w: rms_norm_rows(x, w, eps=1e-5), S((64, 4096), jnp.bfloat16),
                              S((4096,), jnp.bfloat16))
    else:
        text = lower_for_h200(logsumexp_rows, S((16, 128256), jnp.float32))
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("heads_a,heads_b,width", [(32, 4, 128), (5, 3, 80)])
def test_a_pair_of_norms_in_one_launch_is_bitwise_each_alone(dtype, heads_a, heads_b, width):
    """Qwen3's query and key norms as one launch: each output bit for bit its own `rms_norm_rows`."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.normal(0, 2, (3, heads_a, width)), dtype)
    b = jnp.asarray(rng.normal(0, 2, (3, heads_b, width)), dtype)
    wa, wb = (jnp.asarray(rng.normal(1, 0.1, width), dtype) for _ in range(2))
    pair = rms_norm_pair_rows(a, b, wa, wb, eps=1e-6, interpret=True)
    alone = (rms_norm_rows(a, wa, eps=1e-6, interpret=True), rms_norm_rows(b, wb, eps=1e-6, interpret=True))
    for got, want in zip(pair, alone):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32)), f"seed {seed}"
    with pytest.raises(ValueError, match="row width"):
        rms_norm_pair_rows(a, b[..., :16], wa, wb[:16], eps=1e-6, interpret=True)
