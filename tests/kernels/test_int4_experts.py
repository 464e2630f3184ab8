"""4-bit expert stacks (AWQ / GPTQ / compressed-tensors W4A16 MoE checkpoints) through the grouped-matmul kernels
(Pallas interpret mode), packed by this file's own packer and checked against a float64 numpy reference of the
dequantized experts; the MoE layer through them against `ragged_dot` on the same dequantized weights, on one device
and split over two by TP and by expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import ExpertWeights, TileConfig, moe_experts

from jengine.layers.experts import expert_operands
from jengine.layers.mlp import PallasExperts, moe_mlp, moe_mlp_expert_parallel
from jengine.layers.quant4 import Int4Experts, dequantize4
from jengine.parallel.mesh import TP_AXIS
from tests.conftest import fresh_seed
from tests.kernels.test_grouped_matmul import MOE, give_all, leave_empty, numpy_experts

SEED = fresh_seed()


def pack_words(q: np.ndarray) -> np.ndarray:
    """`[..., K, N]` values 0…15 → `[..., K / 8, N]` int32: input row 8r + j of column c at bits 4j of word
    (r, c)."""
    *lead, k, n = q.shape
    rows = q.astype(np.uint32).reshape(*lead, k // 8, 8, n)
    words = sum(rows[..., j, :] << np.uint32(4 * j) for j in range(8))
    return words.astype(np.uint32).view(np.int32)


def quantized_stack(rng, experts: int, k: int, n: int, group: int, dtype):
    """Random 4-bit values, zero points and positive scales per (expert, group, column); returns the packed words,
    zeros and scales (in `dtype`, as checkpoints store float16) and the float64 weight they mean."""
    q = rng.integers(0, 16, size=(experts, k, n))
    zeros = rng.integers(0, 16, size=(experts, k // group, n)).astype(np.float64)
    scales = rng.uniform(0.5, 1.5, size=(experts, k // group, n)) * k ** -0.5 / 4
    zeros_d, scales_d = jnp.asarray(zeros, dtype), jnp.asarray(scales, dtype)
    real = (q - np.repeat(zeros, group, axis=1)) * np.repeat(np.asarray(scales_d, np.float64), group, axis=1)
    return jnp.asarray(pack_words(q)), zeros_d, scales_d, real


def int4_case(rng, tokens, experts_n, k, d, inter, group_up, group_down, dtype):
    gate, up, down = (quantized_stack(rng, experts_n, *shape, g, dtype)
                      for shape, g in (((d, inter), group_up), ((d, inter), group_up), ((inter, d), group_down)))
    packed = ExpertWeights(gate[0], up[0], down[0], gate[2], up[2], down[2], gate[1], up[1], down[1])
    x = jnp.asarray(rng.standard_normal((tokens, d)), dtype)
    experts = np.stack([rng.choice(experts_n, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    routing = jnp.asarray(rng.random((tokens, k)), dtype)
    return x, packed, ExpertWeights(gate[3], up[3], down[3]), experts, routing


# gate/up's 96 columns in 64-column tiles: a ragged N edge; down's K steps of 32 over groups of 16 … 96
TILES = (TileConfig(block_rows=16, block_n=64, block_k=32), TileConfig(block_rows=16, block_n=32, block_k=32))


@pytest.mark.parametrize("groups", [(32, 32), (16, 48), (128, 96)], ids=["group32", "group16-48", "channel"])
@pytest.mark.parametrize("layout", ["random", "one_expert_takes_all", "skipped_and_empty"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_int4_experts_match_float64(groups, layout, dtype):
    rng = np.random.default_rng(SEED)
    x, packed, real, experts, routing = int4_case(rng, 21, 6, 2, 128, 96, *groups, dtype)
    if layout == "one_expert_takes_all":
        give_all(experts, 4)  # 21 rows in one expert: two tiles of it
    if layout == "skipped_and_empty":
        experts[::2, 1] = -1  # another device's experts
        leave_empty(experts, 2)  # expert 2 is never read
    want = numpy_experts(x, real, experts, routing)
    # the test tiles on sorted rows, and the default decode tiles (K steps shrunk to fit) by token
    for configs, order in ((TILES, "sorted"), (None, "by_token")):
        got = moe_experts(x, packed, jnp.asarray(experts), routing, act=jax.nn.silu, interpret=True, configs=configs,
                          precision=jax.lax.Precision.HIGHEST, layout=order)
        tol = 2e-5 if dtype == jnp.float32 else 3e-2  # bf16: the weight tile and hidden rows are rounded to bf16
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol * np.abs(want).max(), rtol=0)


def test_int4_experts_in_activation_order_gather_their_features():
    """GPTQ's desc_act: each expert's stored gate/up row k is feature perm[e, k] of x (a permutation of its own);
    the kernels gather x's features by it and match the float64 reference on the natural-order weights."""
    rng = np.random.default_rng(SEED + 4)
    x, packed, real, experts, routing = int4_case(rng, 13, 6, 2, 128, 96, 32, 32, jnp.float32)
    perm = np.stack([rng.permutation(128) for _ in range(6)]).astype(np.int32)
    natural = lambda w: np.take_along_axis(w, np.argsort(perm, axis=1)[:, :, None], axis=1)  # noqa: E731
    real = real._replace(gate=natural(real.gate), up=natural(real.up))
    got = moe_experts(x, packed._replace(input_perm=jnp.asarray(perm)), jnp.asarray(experts), routing,
                      act=jax.nn.silu, interpret=True, configs=TILES, precision=jax.lax.Precision.HIGHEST)
    want = numpy_experts(x, real, experts, routing)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5 * np.abs(want).max(), rtol=0)


def test_a_group_the_kernels_cannot_step_through_is_refused():
    rng = np.random.default_rng(SEED + 1)
    x, packed, _, experts, routing = int4_case(rng, 4, 6, 2, 128, 96, 32, 24, jnp.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        moe_experts(x, packed, jnp.asarray(experts), routing, act=jax.nn.silu, interpret=True)


def int4_layer(rng, group: int) -> tuple[dict, dict]:
    """A MoE layer (8 experts, d 32, inter 32) with 4-bit experts in groups of `group` (a stack whose K it does not
    divide: one group of all its rows), and its dequantized float twin."""
    w4 = {"router": jnp.asarray(rng.standard_normal((32, 8)) / 32 ** 0.5, jnp.float32)}
    floats = dict(w4)
    for name, (k, n) in (("we_gate", (32, 32)), ("we_up", (32, 32)), ("we_down", (32, 32))):
        words, zeros, scales, real = quantized_stack(rng, 8, k, n, group if k % group == 0 else k, jnp.float32)
        w4[name] = Int4Experts(words, zeros, scales)
        floats[name] = jnp.asarray(real, jnp.float32)
    return w4, floats


def test_int4_stacks_know_their_shape_and_dequantize():
    w4, floats = int4_layer(np.random.default_rng(SEED + 2), 48)
    stack = w4["we_down"]
    assert stack.shape == (8, 32, 32) and stack.group == 32  # 48 does not divide 32: one group of all the rows
    assert stack.nbytes == 8 * 32 * 32 // 2 + 2 * 8 * 1 * 32 * 4
    np.testing.assert_allclose(np.asarray(dequantize4(stack)), np.asarray(floats["we_down"]), rtol=1e-6)


@pytest.mark.parametrize("mode", ["one_device", "tp2", "ep2"])
def test_layer_with_int4_experts_matches_its_dequantized_floats(mode):
    """The layer through the kernels and through `ragged_dot` (which dequantizes the stacks) both give the dequantized
    float layer's output (float32, 2e-5)."""
    rng = np.random.default_rng(SEED + 3)
    w4, floats = int4_layer(rng, 16)
    x = jnp.asarray(rng.standard_normal((9, 32)), jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    want = np.asarray(moe_mlp(x, floats, MOE, "silu", hi))
    operands = expert_operands(w4, jnp.float32)
    assert operands.kind == "int4" and operands.down.weight.dtype == jnp.int32 and operands.down.zero is not None
    if mode == "one_device":
        got = moe_mlp(x, w4, MOE, "silu", hi, PallasExperts(interpret=True))
        np.testing.assert_allclose(np.asarray(moe_mlp(x, w4, MOE, "silu", hi)), want, atol=2e-5)
    else:
        mesh = jax.make_mesh((2,), (TP_AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
        P = jax.sharding.PartitionSpec
        put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
        for name in ("we_gate", "we_up", "we_down"):
            spec = P(TP_AXIS) if mode == "ep2" else P(None, TP_AXIS) if name == "we_down" else P(None, None, TP_AXIS)
            stack = w4[name]
            w4[name] = Int4Experts(put(stack.packed, spec), put(stack.zeros, spec), put(stack.scales, spec))
        x = put(x, P())
        kernels = PallasExperts(interpret=True, mesh=mesh)
        if mode == "ep2":
            got = moe_mlp_expert_parallel(x, w4, MOE, "silu", hi, mesh, TP_AXIS, kernels)
        else:
            got = moe_mlp(x, w4, MOE, "silu", hi, kernels)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_layer_with_packed_gate_up_and_a_float_down(tp):
    """Gate and up in 4 bits, down in float (a checkpoint that keeps its down projections finer): each launch reads
    its own storage; the layer is the dequantized float layer's (float32, 2e-5)."""
    rng = np.random.default_rng(SEED + 5)
    w4, floats = int4_layer(rng, 16)
    w4["we_down"] = floats["we_down"]
    x = jnp.asarray(rng.standard_normal((9, 32)), jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    want = np.asarray(moe_mlp(x, floats, MOE, "silu", hi))
    assert expert_operands(w4, jnp.float32, tp).kind == "int4+float"
    mesh = None
    if tp > 1:
        mesh = jax.make_mesh((tp,), (TP_AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
        P = jax.sharding.PartitionSpec
        put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
        cols = P(None, None, TP_AXIS)
        for name in ("we_gate", "we_up"):
            stack = w4[name]
            w4[name] = Int4Experts(put(stack.packed, cols), put(stack.zeros, cols), put(stack.scales, cols))
        w4["we_down"] = put(w4["we_down"], P(None, TP_AXIS, None))
        x = put(x, P())
    got = moe_mlp(x, w4, MOE, "silu", hi, PallasExperts(interpret=True, mesh=mesh))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
