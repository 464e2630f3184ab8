"""The batch-invariant matmul (`pallas_kernels/invariant_matmul`, interpret mode) against float64 numpy, in both
weight layouts with ragged edges; a row's result bit for bit the same at every row count (each picking another tile
and K step), and under every candidate tile; the Triton lowering for an H200 of 8B-shaped projections and the LM
head at each row class's tile. The gated form (gate/up and SiLU in one launch) likewise, and bit for bit the plain
matmul followed by XLA's `silu(gate) * up`. Tolerance: 1e-5 · max|ref| (float32 inputs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.invariant_matmul import invariant_gated_matmul, invariant_matmul
from pallas_kernels.invariant_matmul.kernel import NARROW_TILES, TILE, WIDE, Tile, gated_tile_for, tile_for


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


@pytest.mark.parametrize("n", [160, 20000], ids=["narrow", "wide"])
def test_a_row_is_the_same_alone_and_in_any_batch(n):
    """Row counts from 1 to 2,100 cross every tile class (K steps of 64, 128 and 256, output tiles 16 to 128 rows)."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    k = 300  # ragged against every K step
    w = jnp.asarray(rng.normal(0, 1, (k, n)).astype(np.float32))
    row = rng.normal(0, 1, (1, k)).astype(np.float32)
    alone = np.asarray(invariant_matmul(jnp.asarray(row), w, interpret=True))[0]
    counts = (5, 64, 130) if n > 160 else (5, 64, 130, 300, 2100)
    assert len({tile_for(m, n) for m in (1, *counts)}) == (2 if n > 160 else 5)
    for m in counts:
        batch = rng.normal(0, 1, (m, k)).astype(np.float32)
        at = int(rng.integers(m))
        batch[at] = row[0]
        out = np.asarray(invariant_matmul(jnp.asarray(batch), w, interpret=True))
        assert np.array_equal(out[at], alone), f"row {at} of {m} differs from the row alone (seed {seed})"


def test_tiles_follow_the_row_count_and_fit_shared_memory():
    """Narrow weights (Llama-3.1-8B's q/k/v, o, down): long K steps on few rows, wider tiles as rows grow; wide
    weights (gate/up, the LM head) the default tile below 128 rows and the wide one above; stages cut for f32."""
    assert [tile_for(m, 4096) for m in (1, 16, 17, 64, 65, 256, 257, 2048)] == [
        t for _, t in NARROW_TILES for _ in (0, 1)]
    assert tile_for(4096, 6144) == WIDE and tile_for(2049, 4096) == WIDE
    assert tile_for(1, 28672) == TILE and tile_for(127, 128256) == TILE and tile_for(128, 28672) == WIDE
    assert tile_for(1, 4096, itemsize=4).num_stages < NARROW_TILES[0][1].num_stages
    assert all(t.stage_bytes(2) * t.num_stages <= 160 * 1024 for t in (TILE, WIDE, *(t for _, t in NARROW_TILES)))


@pytest.mark.parametrize("rows", [1, 64, 256, 1024, 4096])
@pytest.mark.parametrize("transposed,w_shape", [(False, (4096, 6144)), (False, (14336, 4096)), (True, (128256, 4096))])
def test_lowers_for_h200(transposed, w_shape, rows):
    from tests.kernels.test_lowering import S, lower_for_h200

    def call(x, w):
        return invariant_matmul(x, w, transposed=transposed, out_dtype=jnp.float32 if transposed else None)

    k = w_shape[1] if transposed else w_shape[0]
    text = lower_for_h200(call, S((rows, k), jnp.bfloat16), S(w_shape, jnp.bfloat16))
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("tile", [TILE, WIDE, Tile(16, 64, 256), Tile(64, 64, 128), Tile(128, 128, 16)],
                         ids=str)
def test_every_tile_gives_the_same_bits_and_matches_float64(tile):
    """The output tile and K step decide which program computes an output and how much of K a step loads, never
    the additions (one accumulator, 16-wide slices in K order): bf16 and float32 rows equal `TILE`'s bit for bit."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    m, k, n = 150, 700, 300  # ragged in every dimension
    x = rng.normal(0, 1, (m, k))
    w = rng.normal(0, 1, (k, n))
    ref = x @ w
    for dtype in (jnp.bfloat16, jnp.float32):
        xs, ws = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
        ours, base = (np.asarray(invariant_matmul(xs, ws, interpret=True, tile=t), np.float32) for t in (tile, TILE))
        assert np.array_equal(ours, base), f"{tile} in {jnp.dtype(dtype).name} (seed {seed})"
        if dtype == jnp.float32:
            assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()
    with pytest.raises(ValueError, match="MMA slices"):
        invariant_matmul(jnp.asarray(x), jnp.asarray(w), interpret=True, tile=Tile(block_k=24))


def _xla_gated(y, n: int):
    return jax.jit(lambda y: jax.nn.silu(y[:, :n]) * y[:, n:])(y)


@pytest.mark.parametrize("m,k,n", [(1, 72, 100), (70, 130, 136), (130, 300, 40)])
def test_gated_matches_the_unfused_product_bit_for_bit_and_float64(m, k, n):
    """`silu(x @ gate) * (x @ up)` in one launch: bit for bit the plain matmul's stored output followed by XLA's
    `silu(gate) * up` (bf16 and float32), and within 1e-5 · max|ref| of float64 (float32 inputs)."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    x, w = rng.normal(0, 1, (m, k)), rng.normal(0, 1, (k, 2 * n)) / np.sqrt(k)
    for dtype in (jnp.bfloat16, jnp.float32):
        xs, ws = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
        fused = invariant_gated_matmul(xs, ws, interpret=True)
        unfused = _xla_gated(invariant_matmul(xs, ws, interpret=True), n)
        assert fused.shape == (m, n) and fused.dtype == dtype
        assert np.array_equal(np.asarray(fused, np.float32), np.asarray(unfused, np.float32)), f"seed {seed}"
    y = x @ w
    ref = y[:, :n] / (1 + np.exp(-y[:, :n])) * y[:, n:]
    assert np.abs(np.asarray(fused) - ref).max() <= 1e-5 * np.abs(ref).max()


def test_a_gated_row_is_the_same_alone_and_in_any_batch():
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    k, n = 200, 96
    w = jnp.asarray(rng.normal(0, 1, (k, 2 * n)) / np.sqrt(k), jnp.bfloat16)
    row = rng.normal(0, 1, (1, k))
    alone = np.asarray(invariant_gated_matmul(jnp.asarray(row, jnp.bfloat16), w, interpret=True), np.float32)[0]
    counts = (40, 130, 300, 2100)  # with 1: every row class's tile
    assert len({gated_tile_for(m, n) for m in (1, *counts)}) == 5
    for m in counts:
        batch = rng.normal(0, 1, (m, k))
        at = int(rng.integers(m))
        batch[at] = row[0]
        out = np.asarray(invariant_gated_matmul(jnp.asarray(batch, jnp.bfloat16), w, interpret=True), np.float32)
        assert np.array_equal(out[at], alone), f"row {at} of {m} differs from the row alone (seed {seed})"


def test_gated_tiles_hold_what_the_plain_tile_holds():
    for m in (1, 16, 64, 256, 1024, 4096):
        plain, gated = tile_for(m, 28672), gated_tile_for(m, 14336)
        assert gated.block_n * 2 == plain.block_n and gated.stage_bytes(2) < plain.stage_bytes(2)
        assert (gated.block_m, gated.block_k, gated.num_warps, gated.num_stages) == (
            plain.block_m, plain.block_k, plain.num_warps, plain.num_stages)
    with pytest.raises(ValueError, match="odd"):
        invariant_gated_matmul(jnp.ones((2, 8)), jnp.ones((8, 5)), interpret=True)


@pytest.mark.parametrize("rows", [1, 64, 256, 4096])
def test_gated_lowers_for_h200(rows):
    from tests.kernels.test_lowering import S, lower_for_h200

    text = lower_for_h200(invariant_gated_matmul, S((rows, 4096), jnp.bfloat16), S((4096, 28672), jnp.bfloat16))
    assert text.count("__gpu$xla.gpu.triton") == 1
