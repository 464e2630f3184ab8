"""The experts of one MoE layer on the GPU: routing layout, gate/up launch, down launch, combine."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.addressing import next_pow2
from pallas_kernels.grouped_matmul.kernel import TileConfig, expert_down, expert_gate_up
from pallas_kernels.grouped_matmul.routing import combine, expert_tiles


class ExpertWeights(NamedTuple):
    """One layer's stacked experts; the scales (per expert and output column, float32) go with narrow weights."""

    gate: Float[Array, "experts d inter"]
    up: Float[Array, "experts d inter"]
    down: Float[Array, "experts inter d"]
    gate_scale: Float[Array, "experts inter"] | None = None
    up_scale: Float[Array, "experts inter"] | None = None
    down_scale: Float[Array, "experts d"] | None = None


def tile_configs(num_pairs: int, num_experts: int, itemsize: int = 2) -> tuple[TileConfig, TileConfig]:
    """(gate/up, down) tiles for a step of `num_pairs` (token, expert) pairs. Few rows per expert (decode) is
    bandwidth-bound: 16-row tiles, narrow column tiles so the weights spread over every SM. Many rows (prefill) is
    compute-bound: wide tensor-core tiles. Chosen from static shapes only, so a row's arithmetic is fixed by the
    bucket. Wider elements (float32) take shorter K steps, to fit the pipeline stages in shared memory."""
    rows_per_expert = num_pairs / num_experts
    shrink = max(itemsize // 2, 1)
    if rows_per_expert <= 16:
        return (TileConfig(block_rows=16, block_n=32, block_k=256 // shrink, num_warps=4, num_stages=4),
                TileConfig(block_rows=16, block_n=64, block_k=256 // shrink, num_warps=4, num_stages=4))
    rows = min(next_pow2(math.ceil(rows_per_expert)), 64)
    wide = TileConfig(block_rows=rows, block_n=128, block_k=64 // shrink, num_warps=4 if rows <= 32 else 8,
                      num_stages=3)
    return wide, wide


def moe_experts(
    x: Float[Array, "tokens d"], weights: ExpertWeights, experts: Int[Array, "tokens k"],
    routing_weights: Float[Array, "tokens k"], *, act: Callable, precision=None, interpret: bool = False,
    configs: tuple[TileConfig, TileConfig] | None = None,
) -> Float[Array, "tokens d"]:
    """Σ_k routing_weight · down_e(act(gate_e(x)) · up_e(x)) over each token's k experts. Expert ids outside
    `[0, experts)` are skipped (expert parallelism: another device's experts)."""
    num_experts = weights.gate.shape[0]
    up_cfg, down_cfg = configs or tile_configs(experts.size, num_experts, jnp.dtype(x.dtype).itemsize)
    if up_cfg.block_rows != down_cfg.block_rows:
        raise ValueError("both launches tile the same slots: block_rows must agree")
    tiles = expert_tiles(experts, routing_weights, num_experts, up_cfg.block_rows)
    h = expert_gate_up(x, weights.gate, weights.up, tiles, act=act, cfg=up_cfg, interpret=interpret,
                       precision=precision, gate_scale=weights.gate_scale, up_scale=weights.up_scale)
    y = expert_down(h, weights.down, tiles, cfg=down_cfg, interpret=interpret, precision=precision,
                    down_scale=weights.down_scale)
    return combine(y, tiles.pair_slot)
