"""Batched LoRA: each token row adds `B_s(A_s x)` of its request's adapter slot s (scale folded into B).

Every slot's A sits side by side (`[d_in, slots·R]`), so the shrink of all the step's rows against all the slots is
one dense matmul; a one-hot of each row's slot zeroes the other slots' ranks (and every rank of a row without an
adapter), and the expand against the slots' stacked B (`b [slots, R, d_out]`) is a second dense matmul. No sort or
gather of rows: at decode each slot's A and B are read once, which a row grouping would read too, and the rank
columns (slots × R, a few hundred) are small beside the projection's own.

Where the projection's weight is a plain array, the A columns are appended to it (`lora/device.py`), so the shrink
rides in the projection's own matmul: `[y | s] = x · [W | A]`, and only the expand is an extra matmul (measured on
the H200 by `scripts/bench_lora_forms.py`: the fewest launches of the forms tried). A fused projection (q/k/v,
gate/up) is one shrink and one expand.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jengine.layers.linear import Precision, linear


@jax.tree_util.register_dataclass
@dataclasses.dataclass(slots=True)
class LoraRows:
    """Each token row's adapter slot (a step-batch field, built by the runner): `num_slots` for none and padding."""

    token_slots: Int[Array, " tokens"]


def slot_one_hot(rows: LoraRows, num_slots: int, dtype) -> Float[Array, "tokens slots"]:
    """1 where a row's slot is; all zeros for a row without an adapter."""
    return (rows.token_slots[:, None] == jnp.arange(num_slots, dtype=jnp.int32)[None, :]).astype(dtype)


def lora_delta(x: Float[Array, "tokens d_in"], a: Float[Array, "d_in slots parts_r"],
               b: Float[Array, "slots parts_r d_out"], one_hot: Float[Array, "tokens slots"],
               precision: Precision = None) -> Float[Array, "tokens d_out"]:
    """The adapters' addition to one (fused) projection whose weight does not carry the A columns."""
    d_in, slots, ranks = a.shape
    shrunk = jnp.dot(x, a.reshape(d_in, slots * ranks), precision=precision, preferred_element_type=jnp.float32)
    return expand(shrunk, b, one_hot, precision).astype(x.dtype)


def expand(shrunk: Float[Array, "tokens slots_r"], b: Float[Array, "slots parts_r d_out"],
           one_hot: Float[Array, "tokens slots"], precision: Precision) -> Float[Array, "tokens d_out"]:
    """Each row's own slot's ranks (the others zeroed) times the stacked B, in float32."""
    slots, ranks, _ = b.shape
    own = (shrunk.reshape(-1, slots, ranks) * one_hot[:, :, None].astype(shrunk.dtype)).astype(b.dtype)
    return jnp.dot(own.reshape(-1, slots * ranks), b.reshape(slots * ranks, -1), precision=precision,
                   preferred_element_type=jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(slots=True)
class LayerLora:
    """One layer's slot arrays (`lora/device.py`) with the rows' slot one-hot: what the projections need."""

    weights: dict[str, Array]
    one_hot: Float[Array, "tokens slots"]

    def project(self, group: str, x: Float[Array, "tokens d_in"], w, bias: Array | None, precision: Precision
                ) -> Float[Array, "tokens d_out"]:
        """Projection group `group` (qkv, o, gate_up, down) of `x` with the rows' adapters added. Without a
        `<group>_a` array the weight `w` carries every slot's A in its last columns (`lora/device.py`)."""
        b = self.weights[f"{group}_b"]
        if f"{group}_a" in self.weights:
            return linear(x, w, bias, precision) + lora_delta(x, self.weights[f"{group}_a"], b, self.one_hot,
                                                              precision)
        width = b.shape[-1]
        both = jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)
        y = both[:, :width] + expand(both[:, width:], b, self.one_hot, precision)
        return (y if bias is None else y + bias).astype(x.dtype)
