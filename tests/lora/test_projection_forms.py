"""The two forms of a LoRA projection (`layers/lora.py`): the A columns carried by the weight, and kept apart (a
quantized weight's case), each against float64 numpy: y = x·W + b + B_s(A_s x) for each row's slot s, nothing for a
row without an adapter."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jengine.layers.lora import LayerLora, LoraRows, slot_one_hot


@pytest.mark.parametrize("carried", [True, False])
def test_projection_adds_each_rows_own_adapter(carried):
    rng = np.random.default_rng(7 + carried)
    tokens, d_in, d_out, slots, ranks = 9, 24, 20, 3, 4
    x, w, bias = rng.normal(size=(tokens, d_in)), rng.normal(size=(d_in, d_out)), rng.normal(size=d_out)
    a, b = rng.normal(size=(d_in, slots, ranks)), rng.normal(size=(slots, ranks, d_out))
    token_slots = rng.integers(0, slots + 1, tokens)  # `slots`: no adapter
    expected = x @ w + bias
    for row, slot in enumerate(token_slots):
        if slot < slots:
            expected[row] += (x[row] @ a[:, slot]) @ b[slot]
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    weights = {"o_b": f32(b)}
    if carried:
        w = np.concatenate([w, a.reshape(d_in, -1)], axis=1)
    else:
        weights["o_a"] = f32(a)
    one_hot = slot_one_hot(LoraRows(jnp.asarray(token_slots, jnp.int32)), slots, jnp.float32)
    got = LayerLora(weights, one_hot).project("o", f32(x), f32(w), f32(bias), None)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
