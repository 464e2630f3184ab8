"""Batched LoRA: each token row adds `B_s(A_s x)` of its request's adapter slot s (scale folded into B).

The host sorts the step's token rows by slot (`LoraSegments`, built once per step): rows of slot 0, then slot 1, ...,
then the rows without an adapter. The shrink (x·A) and the expand (·B) are then segmented matmuls over those groups
(`segmented_matmul`, the one place a grouped-matmul kernel replaces); rows without an adapter belong to no group,
so they add no work and get a zero delta. The parts of a fused projection share the shrink (`lora/device.py`).
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


def lora_deltas(x: Float[Array, "tokens d_in"], a: Float[Array, "slots d_in parts_r"],
                bs: tuple[Float[Array, "slots r d_out"], ...], segments: LoraSegments,
                precision: Precision = None) -> list[Float[Array, "tokens d_out"]]:
    """The adapter's addition to each part of a projection (one shrink, one expand per part), in row order."""
    rank = bs[0].shape[1]
    sizes = segments.group_sizes
    shrunk = segmented_matmul(x[segments.order], a, sizes, precision).astype(x.dtype)
    inside = (jnp.arange(x.shape[0]) < jnp.sum(sizes))[:, None]
    deltas = []
    for i, b in enumerate(bs):
        y = segmented_matmul(shrunk[:, i * rank:(i + 1) * rank], b, sizes, precision)
        deltas.append(jnp.where(inside, y, 0).astype(x.dtype)[segments.inverse])
    return deltas


@jax.tree_util.register_dataclass
@dataclasses.dataclass(slots=True)
class LayerLora:
    """One layer's slot arrays (`lora/device.py`) with the step's segments: what the projections need."""

    weights: dict[str, Array]
    segments: LoraSegments

    def deltas(self, group: str, parts: tuple[str, ...], x: Array, precision: Precision) -> list[Array]:
        return lora_deltas(x, self.weights[f"{group}_a"], tuple(self.weights[f"{p}_b"] for p in parts),
                           self.segments, precision)

    def has(self, group: str) -> bool:
        return f"{group}_a" in self.weights
