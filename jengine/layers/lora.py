"""Batched LoRA: each token row adds `B_s(A_s x)` of its request's adapter slot s (scale folded into B).

Every slot's A sits side by side (`a [d_in, slots, R]`), so the shrink of all the step's rows against all the slots
is one dense matmul; a one-hot of each row's slot zeroes the other slots' ranks (and every rank of a row without an
adapter), and the expand against the slots' stacked B (`b [slots, R, d_out]`) is a second dense matmul. Two plain
GEMMs per projection group, no sort or gather of rows: at decode they read each slot's A and B once, which a row
grouping would read too, and the rank columns (slots × R, a few hundred) are small beside the projection's own.
A fused projection is one shrink and one expand (`lora/device.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jengine.layers.linear import Precision


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
    """The adapters' addition to one (fused) projection, in row order: one shrink, one expand."""
    d_in, slots, ranks = a.shape
    shrunk = jnp.dot(x, a.reshape(d_in, slots * ranks), precision=precision, preferred_element_type=jnp.float32)
    own = (shrunk.reshape(-1, slots, ranks) * one_hot[:, :, None]).astype(x.dtype)
    expanded = jnp.dot(own.reshape(-1, slots * ranks), b.reshape(slots * ranks, -1), precision=precision,
                       preferred_element_type=jnp.float32)
    return expanded.astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(slots=True)
class LayerLora:
    """One layer's slot arrays (`lora/device.py`) with the rows' slot one-hot: what the projections need."""

    weights: dict[str, Array]
    one_hot: Float[Array, "tokens slots"]

    def delta(self, group: str, x: Array, precision: Precision) -> Array:
        """The addition to projection group `group` (qkv, o, gate_up, down) of input `x`."""
        return lora_delta(x, self.weights[f"{group}_a"], self.weights[f"{group}_b"], self.one_hot, precision)
