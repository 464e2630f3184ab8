"""8-bit expert stacks through the MoE layer: the Pallas grouped-matmul kernels (interpret mode) read per-column
8-bit stacks with their scales, block-scaled ones dequantized, on one device and split over two; all give the layer
of the dequantized float weights (float32, within 2e-5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.layers.mlp import PallasExperts, expert_stacks, moe_mlp
from jengine.layers.quant import FP8, FP8_MAX, QuantizedWeight, QuantScheme, dequantize, expand_scale
from jengine.parallel.mesh import TP_AXIS
from tests.kernels.test_grouped_matmul import MOE, layer_weights

SCHEMES = {"channel": QuantScheme("fp8", "fp8"), "block": QuantScheme("fp8", "fp8", 8, 8, 8)}


def quantized_experts(w: dict, scheme: QuantScheme) -> dict:
    out = dict(w)
    for name in ("we_gate", "we_up", "we_down"):
        stack = np.asarray(w[name], np.float32)
        e, k, n = stack.shape
        if scheme.block_k:
            blocks = np.abs(stack).reshape(e, k // 8, 8, n // 8, 8).max(axis=(2, 4))
        else:
            blocks = np.abs(stack).max(axis=1, keepdims=True)
        scale = jnp.asarray(blocks / FP8_MAX)
        values = jnp.clip(stack / expand_scale(scale, scheme, k, n), -FP8_MAX, FP8_MAX).astype(FP8)
        out[name] = QuantizedWeight.from_kn(values, scale, None, scheme, keep_kn=True)
    return out


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", SCHEMES)
def test_8bit_experts_through_the_kernels_match_their_dequantized_floats(name, tp):
    rng = np.random.default_rng(7)
    w8 = quantized_experts(layer_weights(rng), SCHEMES[name])
    x = jnp.asarray(rng.standard_normal((9, 32)), jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    floats = {k: dequantize(v) if isinstance(v, QuantizedWeight) else v for k, v in w8.items()}
    want = moe_mlp(x, floats, MOE, "silu", hi)
    stacks, scales = expert_stacks(w8, jnp.float32)
    assert (stacks[0].dtype == FP8 and len(scales) == 3) if name == "channel" else scales == ()
    mesh = None
    if tp > 1:
        mesh = jax.make_mesh((tp,), (TP_AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
        P = jax.sharding.PartitionSpec
        col, row = P(None, None, TP_AXIS), P(None, TP_AXIS, None)
        put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
        for key, spec in (("we_gate", col), ("we_up", col), ("we_down", row)):
            q = w8[key]
            scale_spec = P(None, None, TP_AXIS) if key != "we_down" and q.scale.shape[-1] % tp == 0 else P()
            w8[key] = QuantizedWeight(put(q.weight, spec), put(q.scale, scale_spec), None, q.scheme,
                                      q.in_features, True)
        x = put(x, P())
    got = moe_mlp(x, w8, MOE, "silu", hi, PallasExperts(interpret=True, mesh=mesh))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    if tp == 1:  # the ragged_dot path dequantizes through the same hook
        np.testing.assert_allclose(np.asarray(moe_mlp(x, w8, MOE, "silu", hi)), np.asarray(want), atol=2e-5)
