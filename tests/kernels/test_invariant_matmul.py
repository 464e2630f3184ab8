"""The batch-invariant matmul (`pallas_kernels/invariant_matmul`, interpret mode) against float64 numpy, in both
weight layouts with ragged edges; a row's result bit for bit the same at every row count (each picking another tile
and K step), and under every candidate tile; the Triton lowering for an H200 of 8B-shaped projections and the LM
head at each row class's tile. Tolerance: 1e-5 · max|ref| (float32 inputs)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.invariant_matmul import invariant_matmul
from pallas_kernels.invariant_matmul.kernel import NARROW_TILES, TILE, WIDE, Tile, shared_memory_budget, tile_for


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


def _programs(tile: Tile, m: int, n: int) -> int:
    return -(-m // tile.block_m) * -(-n // tile.block_n)


def test_tiles_follow_the_row_count_and_fit_shared_memory():
    """Narrow weights (Llama-3.1-8B's q/k/v, o, down): long K steps on few rows, wider tiles as rows grow, each call
    the candidate tile whose programs fill one wave of 132 SMs the most (an H100's and H200's count); wide weights
    (gate/up, the LM head) the default tile below 128 rows and the wide one above; stages cut for f32."""
    narrow = [t for _, tiles in NARROW_TILES for t in tiles]
    for rows, tiles in NARROW_TILES:
        for m in (rows // 2 + 1, rows):
            for n in (4096, 5120, 6144, 1024):  # o / down, a MoE model's q/k/v, 8B's q/k/v, a TP shard
                chosen = tile_for(m, n, sm_count=132)
                assert chosen in tiles
                fitting = [_programs(t, m, n) for t in tiles if _programs(t, m, n) <= 132]
                assert _programs(chosen, m, n) == max(fitting, default=_programs(tiles[0], m, n))
    assert tile_for(16, 4096, sm_count=132).block_n == 32 and tile_for(16, 6144, sm_count=132).block_n == 64
    assert tile_for(256, 6144, sm_count=132).block_m == 128 and tile_for(256, 4096, sm_count=132).block_m == 64
    assert tile_for(256, 4096, sm_count=64).block_m == 128  # a smaller GPU's wave
    assert tile_for(4096, 6144) == WIDE and tile_for(2049, 4096) == WIDE
    assert tile_for(1, 28672) == TILE and tile_for(127, 128256) == TILE and tile_for(128, 28672) == WIDE
    assert tile_for(1, 6144, itemsize=4).num_stages < tile_for(1, 6144).num_stages
    hopper = shared_memory_budget("9.0")
    assert all(t.stage_bytes(2) * t.num_stages <= hopper for t in (TILE, WIDE, *narrow))
    for capability in ("8.0", "8.9"):  # an A100, an L4: fewer stages of the same tiles, each within the part's limit
        budget = shared_memory_budget(capability)
        for m, n in ((256, 4096), (256, 6144), (16, 4096), (4096, 6144)):
            small, large = tile_for(m, n, sm_count=132, capability=capability), tile_for(m, n, sm_count=132)
            assert small.stage_bytes(2) * small.num_stages <= budget < hopper
            assert dataclasses.replace(small, num_stages=large.num_stages) == large


@pytest.mark.parametrize("rows", [1, 64, 256, 1024, 4096])
@pytest.mark.parametrize("transposed,w_shape", [(False, (4096, 6144)), (False, (14336, 4096)), (True, (128256, 4096))])
def test_lowers_for_h200(transposed, w_shape, rows):
    from tests.kernels.test_lowering import S, lower_for_h200

    def call(x, w):
        return invariant_matmul(x, w, transposed=transposed, out_dtype=jnp.float32 if transposed else None)

    k = w_shape[1] if transposed else w_shape[0]
    text = lower_for_h200(call, S((rows, k), jnp.bfloat16), S(w_shape, jnp.bfloat16))
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("tile", [TILE, WIDE, Tile(16, 64, 256), Tile(16, 32, 128), Tile(64, 64, 128),
                                  Tile(128, 128, 64, num_warps=8), Tile(128, 128, 16)], ids=str)
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
