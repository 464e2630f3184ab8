"""The batch-invariant matmul (`pallas_kernels/invariant_matmul`, interpret mode) against float64 numpy, in both
weight layouts with ragged edges; its K chunks run as programs of their own or inside each program with bit for bit
the same result, and a row's result is bit for bit the same at every row count, on both sides of the switch; the
Triton lowering for an H200 of 8B-shaped projections and the LM head, at decode and prefill row counts. Tolerance:
1e-5 · max|ref| (float32 inputs)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.invariant_matmul import invariant_matmul
from pallas_kernels.invariant_matmul.kernel import k_chunks, split_pays


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


@pytest.mark.parametrize("k", [96, 1100])
def test_a_row_is_the_same_alone_and_in_any_batch(k):
    rng = np.random.default_rng(7 + k)
    n = 160
    w = jnp.asarray(rng.normal(0, 1, (k, n)).astype(np.float32))
    row = rng.normal(0, 1, (1, k)).astype(np.float32)
    alone = np.asarray(invariant_matmul(jnp.asarray(row), w, interpret=True))[0]
    if k_chunks(k, n) > 1:  # both sides of the switch are crossed below
        assert split_pays(64, k, k_chunks(k, n), 4) and not split_pays(130, k, k_chunks(k, n), 4)
    for m, at in ((5, 3), (64, 63), (130, 100)):
        batch = rng.normal(0, 1, (m, k)).astype(np.float32)
        batch[at] = row[0]
        out = np.asarray(invariant_matmul(jnp.asarray(batch), w, interpret=True))
        assert np.array_equal(out[at], alone), f"row {at} of {m} differs from the row alone"


def test_chunks_follow_the_weight_alone():
    """Llama-3.1-8B's projections: the narrow ones (32–48 column tiles of 128) split K until a row tile fills
    132 SMs; the wide ones need no split."""
    assert k_chunks(4096, 6144) == 4  # q/k/v: 48 column tiles
    assert k_chunks(4096, 4096) == 8  # o: 32
    assert k_chunks(14336, 4096) == 8  # down
    assert k_chunks(4096, 28672) == 1 and k_chunks(4096, 128256) == 1  # gate/up, the LM head
    assert k_chunks(300, 128) == 1  # too short a K to split
    assert k_chunks(2048, 128) == 8  # a MoE router: each chunk at least 4 steps of 64
    # a decode step of 64 rows splits each narrow bf16 weight (its partials at most half the weight's bytes)
    assert all(split_pays(64, k, k_chunks(k, n), 2) for k, n in ((4096, 6144), (4096, 4096), (14336, 4096)))
    assert not split_pays(65, 14336, 8, 2) and not split_pays(1, 4096, 1, 2)  # two row tiles; nothing to split
    assert not split_pays(64, 2048, 8, 2)  # a router's partials would outweigh it


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m,k,n", [(3, 1100, 136), (70, 2048, 128)])
def test_chunks_as_programs_or_inside_one_give_the_same_bits(m, k, n, transposed):
    rng = np.random.default_rng(m + k + n + transposed)
    x = jnp.asarray(rng.normal(0, 1, (m, k)).astype(np.float32))
    w_np = rng.normal(0, 1, (n, k) if transposed else (k, n)).astype(np.float32)
    w = jnp.asarray(w_np)
    assert k_chunks(k, n) > 1
    split = np.asarray(invariant_matmul(x, w, transposed=transposed, interpret=True, split=True))
    whole = np.asarray(invariant_matmul(x, w, transposed=transposed, interpret=True, split=False))
    assert np.array_equal(split, whole)
    ref = np.asarray(x, np.float64) @ (w_np.T if transposed else w_np).astype(np.float64)
    assert np.abs(split - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("rows", [16, 256])
@pytest.mark.parametrize("transposed,w_shape", [(False, (4096, 6144)), (False, (14336, 4096)), (True, (128256, 4096))])
def test_lowers_for_h200(transposed, w_shape, rows):
    from tests.kernels.test_lowering import S, lower_for_h200

    def call(x, w):
        return invariant_matmul(x, w, transposed=transposed, out_dtype=jnp.float32 if transposed else None)

    k = w_shape[1] if transposed else w_shape[0]
    text = lower_for_h200(call, S((rows, k), jnp.bfloat16), S(w_shape, jnp.bfloat16))
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("block_m,block_n", [(128, 128), (64, 256), (16, 64)])
def test_another_output_tile_keeps_the_k_steps_and_matches_float64(block_m, block_n):
    """`tile` changes the output tile (the candidates `probe_invariance_gpu.py --tile-candidates` checks for bits on
    the GPU); K steps other than TILE's are refused, since they would change a row's order of additions."""
    from pallas_kernels.invariant_matmul.kernel import TILE, Tile

    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    m, k, n = 150, 700, 300  # ragged in every dimension, K in chunks
    x = rng.normal(0, 1, (m, k)).astype(np.float32)
    w = rng.normal(0, 1, (k, n)).astype(np.float32)
    ours = np.asarray(invariant_matmul(jnp.asarray(x), jnp.asarray(w), interpret=True,
                                       tile=Tile(block_m=block_m, block_n=block_n)))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()
    with pytest.raises(ValueError, match="K steps"):
        invariant_matmul(jnp.asarray(x), jnp.asarray(w), interpret=True, tile=Tile(block_k=2 * TILE.block_k))


@pytest.mark.parametrize("k", [200, 700], ids=["one_chunk", "two_chunks"])
def test_the_wide_tile_gives_the_default_tiles_bits(k):
    """`tile_for`'s wide tile changes which program computes an output, never its additions: bf16 rows equal bit
    for bit to `TILE`'s, with one K chunk (one accumulator) and with two (folded in one loop)."""
    from pallas_kernels.invariant_matmul.kernel import TILE, WIDE, k_chunks

    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    m, n = 150, 300  # ragged in every dimension
    assert k_chunks(k, n) == (1 if k == 200 else 2)
    x = jnp.asarray(rng.normal(0, 1, (m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 1, (k, n)), jnp.bfloat16)
    default, wide = (np.asarray(invariant_matmul(x, w, interpret=True, split=False, tile=t), np.float32)
                     for t in (TILE, WIDE))
    assert np.array_equal(default, wide)
