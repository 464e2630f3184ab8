"""Token rows laid out by expert for the grouped matmul: which slot holds which (token, choice) pair.

Every expert's pairs take a run of slots padded to a multiple of `block_rows`, so each tile of `block_rows` slots
belongs to exactly one expert and a kernel program reads that expert's weights once for all its rows. Experts with
no pairs get no tiles (their weights are never read). The number of slots is static — an upper bound for any
routing — and tiles past `num_tiles` are empty; padding slots carry token -1 and weight 0.

Pairs routed outside `[0, num_experts)` (another device's experts under expert parallelism) get no slot: their
`pair_slot` is `num_slots`, which the combine reads as zero.

Two ways to the same layout: a decode-sized step counts each pair's earlier pairs of the same expert with one
`[pairs, pairs]` comparison (fused elementwise-and-reduce kernels in place of a sort and the gathers through its
order; which is faster on the H200 at each size is for `scripts/bench_moe_kernels.py` to show); a prefill-sized step
sorts the pairs by expert. Within an expert, pairs keep their order either way.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class ExpertTiles(NamedTuple):
    slot_token: Int[Array, " slots"]  # token row of each slot; -1 for padding
    slot_weight: Float[Array, " slots"]  # routing weight of each slot (float32); 0 for padding
    tile_expert: Int[Array, " tiles"]  # expert of each tile (the last used expert for tiles past num_tiles)
    num_tiles: Int[Array, " 1"]  # tiles in use
    pair_slot: Int[Array, "tokens k"]  # slot of each (token, choice); num_slots where the pair has none


def num_slots(num_pairs: int, num_experts: int, block_rows: int) -> int:
    """Slots enough for any routing of `num_pairs` pairs: each used expert pads at most `block_rows - 1` rows."""
    bound = num_pairs + min(num_pairs, num_experts) * (block_rows - 1)
    return -(-bound // block_rows) * block_rows


COMPARE_MAX_PAIRS = 2048  # up to here the [pairs, pairs] comparison (4M elements) is cheaper than a sort


def expert_tiles(experts: Int[Array, "tokens k"], weights: Float[Array, "tokens k"], num_experts: int,
                 block_rows: int, method: Literal["auto", "compare", "sort"] = "auto") -> ExpertTiles:
    """The slot layout of one step's routing (see the module docstring); `method` "auto": comparison up to
    COMPARE_MAX_PAIRS pairs, else the sort."""
    tokens, k = experts.shape
    flat = experts.reshape(-1).astype(jnp.int32)
    kept = (flat >= 0) & (flat < num_experts)
    key = jnp.where(kept, flat, num_experts)
    if method == "auto":
        method = "compare" if flat.shape[0] <= COMPARE_MAX_PAIRS else "sort"
    rank, sizes = (_ranks_by_comparison if method == "compare" else _ranks_by_sort)(key, num_experts)
    padded = -(-sizes // block_rows) * block_rows
    padded_end = jnp.cumsum(padded)
    safe_key = jnp.minimum(key, num_experts - 1)
    slots = num_slots(flat.shape[0], num_experts, block_rows)
    pair_slot = jnp.where(kept, padded_end[safe_key] - padded[safe_key] + rank, slots)
    slot_token = jnp.full((slots,), -1, jnp.int32).at[pair_slot].set(
        jnp.arange(flat.shape[0], dtype=jnp.int32) // k, mode="drop")
    slot_weight = jnp.zeros((slots,), jnp.float32).at[pair_slot].set(weights.reshape(-1).astype(jnp.float32),
                                                                     mode="drop")
    tile_start = jnp.arange(slots // block_rows, dtype=jnp.int32) * block_rows
    # compare_all: one fused comparison; the default binary search is a device loop, ~0.3 ms on an H200
    tile_expert = jnp.minimum(jnp.searchsorted(padded_end, tile_start, side="right", method="compare_all"),
                              num_experts - 1)
    num_tiles = (padded_end[-1] // block_rows).astype(jnp.int32).reshape(1)
    return ExpertTiles(slot_token, slot_weight, tile_expert.astype(jnp.int32), num_tiles,
                       pair_slot.reshape(tokens, k).astype(jnp.int32))


def _ranks_by_comparison(key: Int[Array, " pairs"], num_experts: int) -> tuple[Array, Array]:
    """(each pair's count of earlier pairs with its expert, pairs per expert), by comparing every pair with every
    other: no sort, every step of it a fused elementwise-and-reduce."""
    index = jnp.arange(key.shape[0], dtype=jnp.int32)
    earlier_same = (key[None, :] == key[:, None]) & (index[None, :] < index[:, None])
    rank = jnp.sum(earlier_same, axis=1, dtype=jnp.int32)
    sizes = jnp.sum(key[:, None] == jnp.arange(num_experts, dtype=jnp.int32)[None, :], axis=0, dtype=jnp.int32)
    return rank, sizes


def _ranks_by_sort(key: Int[Array, " pairs"], num_experts: int) -> tuple[Array, Array]:
    """The same from one stable sort by expert and one bincount."""
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    group_start = jnp.cumsum(sizes) - sizes
    sorted_key = key[order]
    sorted_rank = jnp.arange(key.shape[0], dtype=jnp.int32) - group_start[jnp.minimum(sorted_key, num_experts - 1)]
    rank = jnp.zeros_like(key).at[order].set(sorted_rank)
    return rank, sizes


def combine(slot_out: Float[Array, "slots d"], pair_slot: Int[Array, "tokens k"]) -> Float[Array, "tokens d"]:
    """Each token's sum over its k weighted expert outputs (already scaled by the routing weight), in float32."""
    padded = jnp.concatenate([slot_out, jnp.zeros((1, slot_out.shape[1]), slot_out.dtype)])
    return _sum_choices(padded[pair_slot]).astype(slot_out.dtype)


def _sum_choices(rows: Float[Array, "tokens k d"]) -> Float[Array, "tokens d"]:
    """Each token's k rows added in float32, left to right: an XLA reduction's order may follow the shape."""
    rows = rows.astype(jnp.float32)
    total = rows[:, 0]
    for j in range(1, rows.shape[1]):
        total = total + rows[:, j]
    return total
