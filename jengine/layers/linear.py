"""Plain dense projections. Weights are stored `[in, out]` (transposed from HF) so activations multiply on the left."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

Precision = jax.lax.Precision | None


def linear(
    x: Float[Array, "... d_in"],
    w: Float[Array, "d_in d_out"],
    b: Float[Array, " d_out"] | None = None,
    precision: Precision = None,
) -> Float[Array, "... d_out"]:
    y = jnp.dot(x, w, precision=precision)
    return y + b if b is not None else y


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}
