"""The Mosaic GPU grouped matmuls for prefill-sized MoE steps (Mosaic GPU's interpreter) against a float64 numpy
reference; the layer through them as the engine calls it; their lowering for an H200 at a real layer's shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import mosaic, moe_experts
from pallas_kernels.grouped_matmul.routing import expert_tiles

from jengine.layers.mlp import PallasExperts, moe_mlp
from jengine.models.spec import MoeSpec
from tests.conftest import fresh_seed
from tests.kernels.test_grouped_matmul import give_all, leave_empty, numpy_experts, random_case
from tests.kernels.test_lowering import lower_for_h200

SEED = fresh_seed()
# the smallest tiles the kernels take (a warpgroup's 64 rows), with pipelines shorter and longer than K's steps
SMALL = (mosaic.MosaicTiles(block_rows=64, block_n=64, block_k=64, max_concurrent_steps=2),
         mosaic.MosaicTiles(block_rows=64, block_n=64, block_k=64, max_concurrent_steps=3))
# warp-specialised: a memory warpgroup and two compute warpgroups of 64 rows each
SPECIALIZED = (mosaic.MosaicTiles(128, 64, 64, 2, warp_specialized=True),
               mosaic.MosaicTiles(128, 64, 64, 3, warp_specialized=True))


@pytest.mark.parametrize("tiles", [SMALL, SPECIALIZED], ids=["one_warpgroup", "warp_specialized"])
@pytest.mark.parametrize("layout", ["random", "one_expert_takes_all", "skipped_and_empty"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_mosaic_experts_match_float64(layout, dtype, tiles):
    """90 tokens, 2 choices each over 5 experts: experts span one to three row tiles, their last tile partly
    padding; an expert with every token; pairs routed off this device and an expert with no rows."""
    rng = np.random.default_rng(SEED)
    x, w, experts, routing = random_case(rng, 90, 5, 2, 128, 192, dtype)
    if layout == "one_expert_takes_all":
        give_all(experts, 3)  # 90 rows of expert 3: two whole tiles and a partial one
    if layout == "skipped_and_empty":
        experts[::3, 1] = -1
        leave_empty(experts, 1)
    got = moe_experts(x, w, jnp.asarray(experts), routing, act=jax.nn.silu, interpret=True, layout="sorted",
                      mosaic_tiles=tiles)
    want = numpy_experts(x, w, experts, routing)
    # bf16 / f16 products accumulated in float32; the hidden rows stored in the activations' dtype between launches
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-2 * np.abs(want).max(), rtol=0)


def test_unused_tiles_are_not_written_and_padding_rows_are_zero():
    """Tiles past `num_tiles` are left as the output buffer had them (never read by the combine), and the rows
    gathered for padding slots are zero, so a padding slot's down product is zero before its zero routing weight."""
    rng = np.random.default_rng(SEED + 1)
    x, w, experts, routing = random_case(rng, 10, 4, 2, 64, 64, jnp.bfloat16)
    layout = expert_tiles(jnp.asarray(experts), routing, 4, 64)
    xs = mosaic.sorted_rows(x, layout.slot_token)
    tokens = np.asarray(layout.slot_token)
    assert not np.asarray(xs)[tokens < 0].any()
    np.testing.assert_array_equal(np.asarray(xs)[tokens >= 0], np.asarray(x)[tokens[tokens >= 0]])
    h = mosaic.gate_up(xs, w.gate, w.up, layout.tile_expert, layout.num_tiles, act=jax.nn.silu, cfg=SMALL[0],
                       interpret=True)
    used = int(layout.num_tiles[0]) * 64
    for t in range(int(layout.num_tiles[0])):
        e = int(layout.tile_expert[t])
        rows = np.asarray(xs[t * 64:(t + 1) * 64], np.float64)
        g, u = rows @ np.asarray(w.gate[e], np.float64), rows @ np.asarray(w.up[e], np.float64)
        want = g / (1 + np.exp(-g)) * u
        np.testing.assert_allclose(np.asarray(h[t * 64:(t + 1) * 64], np.float64), want,
                                   atol=1e-2 * np.abs(want).max() + 1e-6, rtol=0)
    assert used < h.shape[0]  # the static slot count leaves tiles unused at this routing


def test_warp_specialized_tiles_of_more_rows_than_two_compute_groups_are_refused():
    x = jnp.zeros((256, 64), jnp.bfloat16)
    w = jnp.zeros((2, 64, 64), jnp.bfloat16)
    one = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="at most 128 rows"):
        mosaic.gate_up(x, w, w, one, one, act=jax.nn.silu, cfg=mosaic.MosaicTiles(256, 64, 64, 2, True),
                       interpret=True)


def test_shapes_the_tiles_do_not_fit_are_refused_or_left_to_triton():
    """A float32 or quantized layer, or a width not a whole number of tiles, takes the Triton kernels (the same
    result as without `mosaic_tiles`); the kernels themselves refuse such operands by name."""
    rng = np.random.default_rng(SEED + 2)
    x, w, experts, routing = random_case(rng, 12, 4, 2, 64, 96, jnp.bfloat16)  # 96 = 1.5 tiles of 64
    assert not mosaic.fits(64, 96, SMALL)
    args = (x, w, jnp.asarray(experts), routing)
    with_mosaic = moe_experts(*args, act=jax.nn.silu, interpret=True, layout="sorted", mosaic_tiles=SMALL)
    without = moe_experts(*args, act=jax.nn.silu, interpret=True, layout="sorted")
    np.testing.assert_array_equal(np.asarray(with_mosaic), np.asarray(without))
    layout = expert_tiles(jnp.asarray(experts), routing, 4, 64)
    xs = mosaic.sorted_rows(x, layout.slot_token).astype(jnp.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        mosaic.gate_up(xs, w.gate.astype(jnp.float32), w.up.astype(jnp.float32), layout.tile_expert,
                       layout.num_tiles, act=jax.nn.silu, cfg=SMALL[0], interpret=True)


MOE = MoeSpec(num_experts=4, num_experts_per_tok=2, intermediate_size=128, norm_topk_prob=True, weight_style="qwen")


def test_layer_takes_the_mosaic_kernels_from_its_token_threshold():
    """`PallasExperts.mosaic_min_tokens`: the layer's output through the Mosaic kernels matches the Triton kernels'
    (bf16, sums in another order) above the threshold; under it the Triton kernels run, bit for bit."""
    rng = np.random.default_rng(SEED + 3)
    shape = {"router": (128, 4), "we_gate": (4, 128, 128), "we_up": (4, 128, 128), "we_down": (4, 128, 128)}
    w = {k: jnp.asarray(rng.standard_normal(s) * s[-2] ** -0.5, jnp.bfloat16) for k, s in shape.items()}
    x = jnp.asarray(rng.standard_normal((48, 128)), jnp.bfloat16)
    assert mosaic.fits(128, 128)  # the default tiles take this layer (else the Triton kernels would run both sides)
    triton = moe_mlp(x, w, MOE, "silu", None, PallasExperts(interpret=True))
    from_32 = PallasExperts(interpret=True, mosaic_min_tokens=32)
    assert from_32.mosaic_tiles(48, invariant=False) is not None
    assert from_32.mosaic_tiles(16, invariant=False) is None and from_32.mosaic_tiles(48, invariant=True) is None
    got = moe_mlp(x, w, MOE, "silu", None, from_32)
    scale = float(jnp.abs(triton.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(triton, np.float32), atol=2e-2 * scale, rtol=0)
    short = x[:16]
    np.testing.assert_array_equal(np.asarray(moe_mlp(short, w, MOE, "silu", None, from_32)),
                                  np.asarray(moe_mlp(short, w, MOE, "silu", None, PallasExperts(interpret=True))))


SPECIALIZED_LAYER = (mosaic.MosaicTiles(128, 128, 64, 4, True), mosaic.MosaicTiles(128, 256, 64, 3, True))


@pytest.mark.parametrize("tiles", [mosaic.DEFAULT_TILES, (mosaic.MosaicTiles(64, 128, 64, 4),
                                                          mosaic.MosaicTiles(64, 256, 64, 3)), SPECIALIZED_LAYER],
                         ids=["default", "64_rows", "warp_specialized"])
def test_lowers_for_h200_at_a_qwen3_30b_layer(tiles):
    """4,096 tokens × 8 choices over Qwen3-30B-A3B's 128 experts (hidden 2048, width 768), both launches."""
    S = jax.ShapeDtypeStruct
    up, down = tiles
    slots = 4096 * 8 + 128 * up.block_rows
    text = lower_for_h200(functools.partial(mosaic.gate_up, act=jax.nn.silu, cfg=up), S((slots, 2048), jnp.bfloat16),
                          S((128, 2048, 768), jnp.bfloat16), S((128, 2048, 768), jnp.bfloat16),
                          S((slots // up.block_rows,), jnp.int32), S((1,), jnp.int32))
    text += lower_for_h200(functools.partial(mosaic.down, cfg=down), S((slots, 768), jnp.bfloat16),
                           S((128, 768, 2048), jnp.bfloat16), S((slots // up.block_rows,), jnp.int32),
                           S((1,), jnp.int32), S((slots,), jnp.float32))
    assert text.count("mosaic_gpu") >= 2
