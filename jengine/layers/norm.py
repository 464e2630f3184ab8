"""RMSNorm as HF computes it: statistics in float32, the weight applied after casting back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jengine.layers.invariant import (InvariantNorm, invariant_add_rms_norm, invariant_rms_norm,
                                     invariant_rms_norm_pair)


def rms_norm(x: Float[Array, "... d"], weight: Float[Array, " d"], eps: float) -> Float[Array, "... d"]:
    """`weight` may be an `InvariantNorm` (`--deterministic`): each row then reduced in an order of its own."""
    if isinstance(weight, InvariantNorm):
        if weight.impl != "xla":
            return invariant_rms_norm(x, weight, eps)
        weight = weight.w
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def add_rms_norm(x: Float[Array, "... d"], delta: Float[Array, "... d"], weight: Float[Array, " d"], eps: float
                 ) -> tuple[Float[Array, "... d"], Float[Array, "... d"]]:
    """(x + delta, `rms_norm` of it): a residual add and the norm after it. XLA fuses the two itself; a
    batch-invariant Pallas norm takes the add into its own launch (each output bitwise the unfused one's)."""
    if isinstance(weight, InvariantNorm) and weight.impl != "xla":
        return invariant_add_rms_norm(x, delta, weight, eps)
    total = x + delta
    return total, rms_norm(total, weight, eps)


def rms_norm_pair(a: Float[Array, "... d"], b: Float[Array, "... d"], weight_a: Float[Array, " d"],
                  weight_b: Float[Array, " d"], eps: float) -> tuple[Float[Array, "... d"], Float[Array, "... d"]]:
    """(`rms_norm(a, weight_a)`, `rms_norm(b, weight_b)`): a model's query and key norms. Batch-invariant Pallas
    norms run both in one launch (each bitwise the separate one); XLA schedules the pair itself."""
    fused = all(isinstance(w, InvariantNorm) and w.impl != "xla" for w in (weight_a, weight_b))
    if fused and weight_a.impl == weight_b.impl and a.shape[-1] == b.shape[-1]:
        return invariant_rms_norm_pair(a, b, weight_a, weight_b, eps)
    return rms_norm(a, weight_a, eps), rms_norm(b, weight_b, eps)
