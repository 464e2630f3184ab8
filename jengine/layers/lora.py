"""Batched LoRA: each token row adds `B_s(A_s x)` of its request's adapter slot s (scale folded into B).

The host sorts the step's token rows by slot (`LoraSegments`, built once per step): rows of slot 0, then slot 1, ...,
then the rows without an adapter. The shrink (x·A) and the expand (·B) are then segmented matmuls over those groups
(`segmented_matmul`, the one place a grouped-matmul kernel replaces); rows without an adapter belong to no group,
so they add no work and get a zero delta. A fused projection is one shrink and one expand (`lora/device.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jengine.layers.linear import Precision


@jax.tree_util.register_dataclass
@dataclasses.dataclass(slots=True)
class LoraSegments:
    """The step's token rows grouped by adapter slot (a step-batch field, built by the runner)."""

    order: Int[Array, " tokens"]  # token rows sorted by slot; rows without an adapter (and padding) last
    inverse: Int[Array, " tokens"]  # where each token row sits in `order`
    group_sizes: Int[Array, " slots"]  # rows of each slot, in slot order; the rest of `order` has no adapter


def segmented_matmul(x_sorted: Float[Array, "tokens k"], w: Float[Array, "slots k n"],
                     group_sizes: Int[Array, " slots"], precision: Precision = None) -> Float[Array, "tokens n"]:
    """Row block g of `x_sorted` times `w[g]`, in float32; rows past the groups are left undefined (the caller
    masks them). The jnp version; a grouped-matmul kernel with this signature can take its place."""
    return jax.lax.ragged_dot(x_sorted, w, group_sizes, precision=precision, preferred_element_type=jnp.float32)


def lora_delta(x: Float[Array, "tokens d_in"], a: Float[Array, "slots d_in parts_r"],
               b: Float[Array, "slots parts_r d_out"], segments: LoraSegments,
               precision: Precision = None) -> Float[Array, "tokens d_out"]:
    """The adapters' addition to one (fused) projection, in row order: one shrink, one expand."""
    sizes = segments.group_sizes
    shrunk = segmented_matmul(x[segments.order], a, sizes, precision).astype(x.dtype)
    expanded = segmented_matmul(shrunk, b, sizes, precision)
    inside = (jnp.arange(x.shape[0]) < jnp.sum(sizes))[:, None]
    return jnp.where(inside, expanded, 0).astype(x.dtype)[segments.inverse]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(slots=True)
class LayerLora:
    """One layer's slot arrays (`lora/device.py`) with the step's segments: what the projections need."""

    weights: dict[str, Array]
    segments: LoraSegments

    def delta(self, group: str, x: Array, precision: Precision) -> Array:
        """The addition to projection group `group` (qkv, o, gate_up, down) of input `x`."""
        return lora_delta(x, self.weights[f"{group}_a"], self.weights[f"{group}_b"], self.segments, precision)
