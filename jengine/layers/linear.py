"""Dense projections. Weights are stored `[in, out]` (transposed from HF) so activations multiply on the left; an
8-bit weight (`layers/quant.py:QuantizedWeight`) or a 4-bit one (`layers/quant4.py:Int4Weight`) takes its own
matmul, so every projection of every family runs quantized checkpoints; a batch-invariant one
(`layers/invariant.py:InvariantWeight`, `--deterministic`) likewise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jengine.layers.invariant import InvariantWeight, invariant_matmul
from jengine.layers.quant import QuantizedWeight, quantized_matmul
from jengine.layers.quant4 import Int4Weight, int4_matmul

Precision = jax.lax.Precision | None


def linear(
    x: Float[Array, "... d_in"],
    w: Float[Array, "d_in d_out"] | QuantizedWeight | Int4Weight | InvariantWeight,
    b: Float[Array, " d_out"] | None = None,
    precision: Precision = None,
) -> Float[Array, "... d_out"]:
    if isinstance(w, QuantizedWeight):
        y = quantized_matmul(x.reshape(-1, x.shape[-1]), w, precision).reshape(*x.shape[:-1], w.shape[-1])
    elif isinstance(w, Int4Weight):
        y = int4_matmul(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[-1])
    elif isinstance(w, InvariantWeight):
        y = invariant_matmul(x.reshape(-1, x.shape[-1]), w, precision).reshape(*x.shape[:-1], w.shape[-1])
    else:
        y = jnp.dot(x, w, precision=precision)
    return y + b if b is not None else y


def split_fused(y: Float[Array, "... total"], widths: tuple[int, ...], shards: int) -> list[Array]:
    """The parts of a fused projection's output (`models/weights.py`: columns grouped per shard, each shard holding
    its slice of every part in order). Reshaping the shard axis out keeps a tensor-parallel split local."""
    grouped = y.reshape(*y.shape[:-1], shards, sum(widths) // shards)
    bounds = np.cumsum([w // shards for w in widths])[:-1].tolist()
    return [part.reshape(*y.shape[:-1], width)
            for part, width in zip(jnp.split(grouped, bounds, axis=-1), widths, strict=True)]


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}
