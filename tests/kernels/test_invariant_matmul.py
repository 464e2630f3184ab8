"""The batch-invariant matmul (`pallas_kernels/invariant_matmul`, interpret mode) against float64 numpy, in both
weight layouts with ragged edges; a row's result bit for bit the same at every row count (each picking another tile
and K step), and under every candidate tile; the Triton lowering for an H200 of 8B-shaped projections and the LM
head at each row class's tile. Tolerance: 1e-5 · max|ref| (float32 inputs)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.invariant_matmul import gated_invariant_matmul, invariant_matmul
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


# (x · (1 + tanh z) / 2 as x · sigmoid(2z): in float64 too, tanh z rounds to -1 from z < -19 and the GELU to 0)
ACTIVATIONS_64 = {"silu": lambda g: g / (1 + np.exp(-g)),
                  "gelu_pytorch_tanh": lambda g: g / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))}


def _gated_reference(gate_up: np.ndarray, dtype, activation: str = "silu") -> np.ndarray:
    """act(gate) · up from float64 sums: each rounded to `dtype`, the float64 activation rounded, then the product
    (the unfused MLP's roundings, with torch's one-rounding activations)."""
    def rounded(a):
        return a if dtype == np.float64 else np.asarray(jnp.asarray(a, dtype), np.float64)

    gate, up = np.split(rounded(gate_up), 2, axis=-1)
    return rounded(rounded(ACTIVATIONS_64[activation](gate)) * up)


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("m,k,n", [(1, 72, 100), (70, 130, 136), (300, 96, 520)])
def test_gated_matches_float64_and_the_unfused_gate_and_up(m, k, n, activation):
    """act(x @ gate) · (x @ up) in one launch: float32 against float64 sums (1e-5 · max|ref|); bf16 the unfused
    kernel's gate and up sums, activated and multiplied with the same roundings (silu: bit for bit; the GELU, its
    tanh spelled as a sigmoid, a bf16 step apart on a few elements, mostly where it is ~0)."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    x, w = rng.normal(0, 1, (m, k)), rng.normal(0, 0.2, (k, 2 * n))
    ref = _gated_reference(x @ w, np.float64, activation)
    ours = np.asarray(gated_invariant_matmul(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
                                             activation=activation, interpret=True))
    assert ours.shape == (m, n)
    assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max(), f"seed {seed}"
    xs, ws = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    unfused = np.asarray(invariant_matmul(xs, ws, interpret=True, out_dtype=jnp.float32), np.float64)
    fused = np.asarray(gated_invariant_matmul(xs, ws, activation=activation, interpret=True), np.float64)
    expected = _gated_reference(unfused, jnp.bfloat16, activation)
    if activation == "silu":
        assert np.array_equal(fused, expected), f"seed {seed}"
    else:  # a bf16 step of the activation apart (two after the product), rarely outside the far negative tail,
        # where float32's exponential overflows and the GELU's ~1e-38 comes out 0
        floor = 1e-6 * np.abs(expected).max()
        assert np.all(np.abs(fused - expected) <= 2 ** -6 * np.abs(expected) + floor), f"seed {seed}"
        visible = np.abs(expected) > 1e-3 * np.abs(expected).max()
        assert np.mean(fused[visible] != expected[visible]) < 0.01, f"seed {seed}"


def test_gated_row_is_the_same_alone_and_in_any_batch():
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    k, n = 200, 9000  # a wide weight: the default tile below 128 rows, the wide one above
    w = jnp.asarray(rng.normal(0, 0.1, (k, 2 * n)), jnp.bfloat16)
    row = rng.normal(0, 1, (1, k))
    alone = np.asarray(gated_invariant_matmul(jnp.asarray(row, jnp.bfloat16), w, interpret=True))[0]
    for m in (7, 130):
        batch = rng.normal(0, 1, (m, k))
        at = int(rng.integers(m))
        batch[at] = row[0]
        out = np.asarray(gated_invariant_matmul(jnp.asarray(batch, jnp.bfloat16), w, interpret=True))
        assert np.array_equal(out[at], alone), f"row {at} of {m} (seed {seed})"


def test_gated_refuses_what_it_cannot_compute():
    x, w = jnp.zeros((2, 32)), jnp.zeros((32, 64))
    with pytest.raises(ValueError, match="activation|silu"):
        gated_invariant_matmul(x, w, activation="relu", interpret=True)
    with pytest.raises(ValueError, match=r"\[k, 2n\]"):
        gated_invariant_matmul(x, jnp.zeros((32, 63)), interpret=True)


@pytest.mark.parametrize("rows", [1, 64, 256, 2048])
def test_gated_lowers_for_h200(rows):
    from tests.kernels.test_lowering import S, lower_for_h200

    text = lower_for_h200(lambda x, w: gated_invariant_matmul(x, w), S((rows, 4096), jnp.bfloat16),
                          S((4096, 28672), jnp.bfloat16))
    assert text.count("__gpu$xla.gpu.triton") == 1
