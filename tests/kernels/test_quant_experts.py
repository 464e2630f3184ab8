"""8-bit expert stacks through the MoE layer: the Pallas grouped-matmul kernels (interpret mode) read per-column and
block-scaled 8-bit stacks (DeepSeek/Qwen3-FP8's blocks, group-wise int8) with their scales, on one device and split
over two; blocks the kernels cannot step through (under 16 rows, or cut by the split) are dequantized; all give the
layer of the dequantized float weights (float32, within 2e-5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.layers.experts import expert_operands
from jengine.layers.mlp import PallasExperts, moe_mlp
from jengine.layers.quant import FP8, FP8_MAX, QuantizedWeight, QuantScheme, dequantize, expand_scale
from jengine.parallel.mesh import TP_AXIS
from tests.kernels.test_grouped_matmul import MOE, layer_weights

SCHEMES = {"channel": QuantScheme("fp8", "fp8"), "block8": QuantScheme("fp8", "fp8", 8, 8, 8),
           "block16": QuantScheme("fp8", "fp8", 16, 16, 16), "int8_group32": QuantScheme("int8", None, 32, 1)}
KIND = {"channel": "column", "block8": "float", "block16": "block", "int8_group32": "block"}


def quantized_experts(w: dict, scheme: QuantScheme) -> dict:
    out = dict(w)
    top = FP8_MAX if scheme.weight_dtype == "fp8" else 127.0
    for name in ("we_gate", "we_up", "we_down"):
        stack = np.asarray(w[name], np.float32)
        e, k, n = stack.shape
        if scheme.block_k:  # ceil-sized blocks: a ragged edge block covers what is left
            bk, bn = scheme.block_k, scheme.block_n
            padded = np.zeros((e, -(-k // bk) * bk, -(-n // bn) * bn), np.float32)
            padded[:, :k, :n] = np.abs(stack)
            blocks = padded.reshape(e, -(-k // bk), bk, -(-n // bn), bn).max(axis=(2, 4))
        else:
            blocks = np.abs(stack).max(axis=1, keepdims=True)
        scale = jnp.asarray(blocks / top)
        scaled = jnp.clip(stack / expand_scale(scale, scheme, k, n), -top, top)
        values = scaled.astype(FP8) if scheme.weight_dtype == "fp8" else jnp.round(scaled).astype(jnp.int8)
        out[name] = QuantizedWeight.from_kn(values, scale, None, scheme, keep_kn=True)
    return out


def wide_layer(rng) -> dict:
    """8 experts, d 32, inter 64: 16-row blocks split whole over 2 devices (gate/up by columns, down by rows)."""
    shape = {"router": (32, 8), "we_gate": (8, 32, 64), "we_up": (8, 32, 64), "we_down": (8, 64, 32)}
    return {k: jnp.asarray(rng.standard_normal(s) * s[-2] ** -0.5, jnp.float32) for k, s in shape.items()}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("wide", [False, True], ids=["inter24", "inter64"])
@pytest.mark.parametrize("name", SCHEMES)
def test_8bit_experts_through_the_kernels_match_their_dequantized_floats(name, wide, tp):
    rng = np.random.default_rng(7)
    w8 = quantized_experts(wide_layer(rng) if wide else layer_weights(rng), SCHEMES[name])
    x = jnp.asarray(rng.standard_normal((9, 32)), jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    floats = {k: dequantize(v) if isinstance(v, QuantizedWeight) else v for k, v in w8.items()}
    want = moe_mlp(x, floats, MOE, "silu", hi)
    operands = expert_operands(w8, jnp.float32, tp)
    # inter 24 over 2 devices cuts 16-row (and 32-row) blocks: down (and gate/up's 16-column blocks) dequantized
    kinds = (KIND[name], KIND[name])
    if tp == 2 and not wide and name == "block16":
        kinds = ("float", "float")
    if tp == 2 and not wide and name == "int8_group32":
        kinds = ("block", "float")
    assert (operands.gate.kind, operands.down.kind) == kinds
    for op, kind in ((operands.gate, kinds[0]), (operands.up, kinds[0]), (operands.down, kinds[1])):
        assert (op.weight.dtype != jnp.float32 and op.scale is not None) == (kind != "float")
    mesh = None
    if tp > 1:
        mesh = jax.make_mesh((tp,), (TP_AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
        P = jax.sharding.PartitionSpec
        col, row = P(None, None, TP_AXIS), P(None, TP_AXIS, None)
        put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
        for key, spec in (("we_gate", col), ("we_up", col), ("we_down", row)):
            q, kind = w8[key], kinds[key == "we_down"]
            if kind == "block":  # block scales split as their weights
                scale_spec = spec
            else:  # column scales split with gate/up's columns; blocks cut by the split replicated
                scale_spec = P(None, None, TP_AXIS) if key != "we_down" and kind == "column" else P()
            w8[key] = QuantizedWeight(put(q.weight, spec), put(q.scale, scale_spec), None, q.scheme,
                                      q.in_features, True)
        x = put(x, P())
    got = moe_mlp(x, w8, MOE, "silu", hi, PallasExperts(interpret=True, mesh=mesh))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    if tp == 1:  # the ragged_dot path dequantizes through the same hook
        np.testing.assert_allclose(np.asarray(moe_mlp(x, w8, MOE, "silu", hi)), np.asarray(want), atol=2e-5)
