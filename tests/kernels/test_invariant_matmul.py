"""The batch-invariant matmul (`pallas_kernels/invariant_matmul`, interpret mode) against float64 numpy, in both
weight layouts with ragged edges, and a row's result bit for bit the same at every row count; the Triton lowering
for an H200 of an 8B-shaped projection and LM head. Tolerance: 1e-5 · max|ref| (float32 inputs)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.invariant_matmul import invariant_matmul


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 72, 200), (70, 130, 136)])
def test_matches_float64(m, k, n, transposed):
    rng = np.random.default_rng(m * 1000 + k + n + transposed)
    x = rng.normal(0, 1, (m, k)).astype(np.float32)
    w = rng.normal(0, 1, (n, k) if transposed else (k, n)).astype(np.float32)
    ours = np.asarray(invariant_matmul(jnp.asarray(x), jnp.asarray(w), transposed=transposed, interpret=True))
    ref = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
    assert ours.shape == (m, n)
    assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()


def test_a_row_is_the_same_alone_and_in_any_batch():
    rng = np.random.default_rng(7)
    k, n = 96, 160
    w = jnp.asarray(rng.normal(0, 1, (k, n)).astype(np.float32))
    row = rng.normal(0, 1, (1, k)).astype(np.float32)
    alone = np.asarray(invariant_matmul(jnp.asarray(row), w, interpret=True))[0]
    for m, at in ((5, 3), (64, 63), (130, 100)):
        batch = rng.normal(0, 1, (m, k)).astype(np.float32)
        batch[at] = row[0]
        out = np.asarray(invariant_matmul(jnp.asarray(batch), w, interpret=True))
        assert np.array_equal(out[at], alone), f"row {at} of {m} differs from the row alone"


@pytest.mark.parametrize("transposed,w_shape", [(False, (4096, 6144)), (True, (128256, 4096))])
def test_lowers_for_h200(transposed, w_shape):
    from tests.kernels.test_lowering import S, lower_for_h200

    def call(x, w):
        return invariant_matmul(x, w, transposed=transposed, out_dtype=jnp.float32 if transposed else None)

    text = lower_for_h200(call, S((16, 4096), jnp.bfloat16), S(w_shape, jnp.bfloat16))
    assert text.count("__gpu$xla.gpu.triton") == 1
