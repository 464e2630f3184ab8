"""The experts of one MoE layer on the GPU: routing layout, gate/up launch, down launch, combine."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.addressing import next_pow2
from pallas_kernels.grouped_matmul.kernel import (Scaling, TileConfig, TokenChoices, expert_down, expert_gate_up,
                                                  scaling_of)
from pallas_kernels.grouped_matmul import mosaic
from pallas_kernels.grouped_matmul.combine import combine_pairs, combine_slots
from pallas_kernels.grouped_matmul.router import ChosenExperts
from pallas_kernels.grouped_matmul.routing import expert_tiles


class ExpertWeights(NamedTuple):
    """One layer's stacked experts. Float ones alone; 8-bit ones with a scale per (expert, output column) `[experts,
    N]` or per (expert, block) `[experts, K blocks, N blocks]` (with `moe_experts`' `scale_block`); 4-bit ones as int32
    words `[experts, K / 8, N]` with a zero point and a scale per (expert, group of K rows, column) (`kernel.py`
    gives the packing)."""

    gate: Float[Array, "experts d inter"] | Int[Array, "experts d8 inter"]
    up: Float[Array, "experts d inter"] | Int[Array, "experts d8 inter"]
    down: Float[Array, "experts inter d"] | Int[Array, "experts inter8 d"]
    gate_scale: Float[Array, "experts ..."] | None = None
    up_scale: Float[Array, "experts ..."] | None = None
    down_scale: Float[Array, "experts ..."] | None = None
    gate_zero: Float[Array, "experts groups inter"] | None = None  # 4-bit only
    up_zero: Float[Array, "experts groups inter"] | None = None
    down_zero: Float[Array, "experts groups d"] | None = None
    # 4-bit, GPTQ's activation order: gate's and up's stored row k of expert e is feature input_perm[e, k] of x
    input_perm: Int[Array, "experts d"] | None = None


# Programs per SM of both tile sets (`TileConfig.workers_per_sm`). On an H100 (Qwen3-30B-A3B layer, 16-layer device
# loop; `benchmarks/results/2026-12-06-moe-grid-f22c2a5.json`) 2 against one program per tile: 43.2 vs 54.6 µs at 1
# token, 298 vs 366 at 16, 468 vs 575 at 64, 1,258 vs 1,427 at 4,096; 1 and 4 within 3 % of 2 at every size.
WORKERS_PER_SM = 2
# Down's K (the expert width, 768 for Qwen3-30B-A3B) is short: steps of 128 rows fit two programs an SM where 256
# fit one. In the engine's decode step on an H100 (CUPTI, 12 layers, the listed router): 11.5 against 13.7 us a
# layer at batch 1, 46.7 against 48.5 at 16. Gate/up keeps 256 (128: 21.9 against 22.9 at batch 1, but 103.0
# against 94.2 at 16). Gate/up's column tiles are 32 wide at 16 rows (a step of 1 to 16 tokens: 8 experts' 64-wide
# tiles would not fill the SMs) and 64 wide at 32 rows (128 to 256 tokens; 128-byte runs of each weight row): at
# batch 256 on an H200 156.3 against 169.0 us a layer.
DECODE_DOWN_BLOCK_K = 128


def with_rows(cfg: TileConfig, rows: int) -> TileConfig:
    """`cfg` with `rows` rows a tile and its K steps shortened in proportion, so each pipeline stage keeps the
    shared memory of the configured tile (64 rows at the decode tiles' 16 × 256 would ask for 256 KiB a launch; an
    H100 has 227)."""
    return dataclasses.replace(cfg, block_rows=rows, block_k=max(16, cfg.block_k * cfg.block_rows // rows))


def tile_configs(num_pairs: int, num_experts: int, itemsize: int = 2) -> tuple[TileConfig, TileConfig]:
    """(gate/up, down) tiles for a step of `num_pairs` (token, expert) pairs. Few rows per expert (decode) is
    bandwidth-bound: narrow column tiles so the weights spread over every SM. Many rows (prefill): wide tensor-core
    tiles. Chosen from static shapes only. Wider elements (float32) take shorter K steps, to fit the pipeline
    stages in shared memory.

    A row tile reads its expert's whole weight, so an expert with more rows than a tile reads it again per tile.
    Rows per expert vary around their mean (uniform routing: Poisson-like), so the tile holds twice the mean: 16-row
    tiles at 16 rows per expert (256 tokens of Qwen3-30B-A3B) read each routed expert 1.44 times on average, and the
    H100 layer took 580 µs against a floor of 402 (`benchmarks/results/2026-12-06-moe-grid-2a0e0df.json`)."""
    rows_per_expert = num_pairs / num_experts
    shrink = max(itemsize // 2, 1)
    rows = max(16, next_pow2(math.ceil(2 * rows_per_expert)))
    if rows <= 32:  # decode: 16-row tiles, their K steps shortened if the rows grow (`with_rows`)
        decode = (TileConfig(block_rows=16, block_n=32 if rows <= 16 else 64, block_k=256 // shrink, num_warps=4,
                             num_stages=4, workers_per_sm=WORKERS_PER_SM),
                  TileConfig(block_rows=16, block_n=64, block_k=DECODE_DOWN_BLOCK_K // shrink, num_warps=4,
                             num_stages=4, workers_per_sm=WORKERS_PER_SM))
        return tuple(with_rows(c, rows) for c in decode)
    rows = min(rows, 64)
    wide = TileConfig(block_rows=rows, block_n=128, block_k=64 // shrink, num_warps=8, num_stages=3,
                      workers_per_sm=WORKERS_PER_SM)
    return wide, wide


def fit_steps(cfg: TileConfig, k_dim: int, scaling: Scaling) -> TileConfig:
    """`cfg` with the largest K step at most its own that the weights' scaling allows: within one block row (block
    scales), or dividing K and dividing or a multiple of the group (4-bit). 16 fits any block or group of a
    multiple of 16."""
    def fits(block_k: int) -> bool:
        if scaling.kind == "block":
            return scaling.rows % block_k == 0
        if scaling.kind == "int4":
            return k_dim % block_k == 0 and (scaling.rows % block_k == 0 or block_k % scaling.rows == 0)
        return True

    block_k = cfg.block_k
    while block_k > 16 and not fits(block_k):
        block_k //= 2
    return dataclasses.replace(cfg, block_k=block_k)


BY_TOKEN_MAX_TOKENS = 16  # up to here a step skips the routing layout (`kernel.Layout`); above, the rows are sorted


def by_token_tile(cfg: TileConfig, tokens: int) -> TileConfig:
    """`cfg` for the by-token layout, whose row tile holds every token of the step (`with_rows`)."""
    return with_rows(cfg, max(cfg.block_rows, next_pow2(tokens)))


def layout_for(tokens: int, layout: Literal["auto", "sorted", "by_token"]) -> Literal["sorted", "by_token"]:
    if layout == "auto":
        return "by_token" if tokens <= BY_TOKEN_MAX_TOKENS else "sorted"
    return layout


def moe_experts(
    x: Float[Array, "tokens d"], weights: ExpertWeights, experts: Int[Array, "tokens k"],
    routing_weights: Float[Array, "tokens k"], *, act: Callable, precision=None, interpret: bool = False,
    configs: tuple[TileConfig, TileConfig] | None = None, scale_block: tuple[int, int] | None = None,
    layout: Literal["auto", "sorted", "by_token"] = "auto", chosen: ChosenExperts | None = None,
    residual: Float[Array, "tokens d"] | None = None,
    mosaic_tiles: tuple[mosaic.MosaicTiles, mosaic.MosaicTiles] | None = None,
) -> Float[Array, "tokens d"]:
    """Σ_k routing_weight · down_e(act(gate_e(x)) · up_e(x)) over each token's k experts. Expert ids outside
    `[0, experts)` are skipped (expert parallelism: another device's experts). `scale_block`: the (rows, columns) of
    8-bit block scales (`[experts, K blocks, N blocks]`), None for any other storage. `layout`: how the kernels
    find each expert's rows (`kernel.Layout`); "auto": by token for decode-sized steps, else sorted. `chosen`: the
    distinct experts the step chose, as the router lists them (`router.top_k_routing_listed`), which the by-token
    layout then reads instead of finding them in every program. `residual`: added to the result inside the
    combine launch. `mosaic_tiles`: the (gate/up, down) tiles of the Mosaic GPU kernels (`mosaic.py`, Hopper), taken
    for sorted-layout steps of float experts whose shapes they fit; elsewhere (and None) the Triton kernels."""
    if mosaic_tiles is not None and _takes_mosaic(x, weights, layout_for(x.shape[0], layout), mosaic_tiles):
        return _mosaic_experts(x, weights, experts, routing_weights, act=act, tiles=mosaic_tiles,
                               interpret=interpret, residual=residual)
    num_experts = weights.gate.shape[0]
    up_cfg, down_cfg = configs or tile_configs(experts.size, num_experts, jnp.dtype(x.dtype).itemsize)
    if up_cfg.block_rows != down_cfg.block_rows:
        raise ValueError("both launches tile the same slots: block_rows must agree")
    inter = weights.gate.shape[2]
    by_token = layout_for(x.shape[0], layout) == "by_token"
    if by_token:
        up_cfg, down_cfg = (by_token_tile(c, x.shape[0]) for c in (up_cfg, down_cfg))
    up_cfg = fit_steps(up_cfg, x.shape[1], scaling_of(weights.gate, x.shape[1], weights.gate_scale,
                                                      weights.gate_zero, scale_block))
    down_cfg = fit_steps(down_cfg, inter, scaling_of(weights.down, inter, weights.down_scale, weights.down_zero,
                                                     scale_block))
    if by_token:
        # the weights as given: the down launch widens each to float32 as it loads it (no conversion launch)
        tiles = TokenChoices(experts.astype(jnp.int32), routing_weights.reshape(-1), chosen)
    else:
        tiles = expert_tiles(experts, routing_weights, num_experts, up_cfg.block_rows)
    h = expert_gate_up(x, weights.gate, weights.up, tiles, act=act, cfg=up_cfg, interpret=interpret,
                       precision=precision, gate_scale=weights.gate_scale, up_scale=weights.up_scale,
                       gate_zero=weights.gate_zero, up_zero=weights.up_zero, scale_block=scale_block,
                       input_perm=weights.input_perm)
    y = expert_down(h, weights.down, tiles, cfg=down_cfg, interpret=interpret, precision=precision,
                    down_scale=weights.down_scale, down_zero=weights.down_zero, scale_block=scale_block)
    if isinstance(tiles, TokenChoices):
        return combine_pairs(y, experts, num_experts, interpret=interpret, residual=residual)
    return combine_slots(y, tiles.pair_slot, interpret=interpret, residual=residual)


def _takes_mosaic(x, weights: ExpertWeights, layout: str, tiles: tuple[mosaic.MosaicTiles, mosaic.MosaicTiles]
                  ) -> bool:
    """Float experts (no scales, zero points or permutation), the sorted layout, shapes the tiles fit."""
    quantized = any(a is not None for a in weights[3:])
    return (layout == "sorted" and not quantized and weights.gate.dtype == x.dtype
            and jnp.dtype(x.dtype) in mosaic.FLOAT_DTYPES and mosaic.fits(x.shape[1], weights.gate.shape[2], tiles))


def _mosaic_experts(x, weights: ExpertWeights, experts, routing_weights, *, act: Callable,
                    tiles: tuple[mosaic.MosaicTiles, mosaic.MosaicTiles], interpret: bool, residual):
    """The sorted layout in row tiles of the Mosaic kernels' size, their two launches, the Triton combine."""
    up_tiles, down_tiles = tiles
    layout = expert_tiles(experts, routing_weights, weights.gate.shape[0], up_tiles.block_rows)
    xs = mosaic.sorted_rows(x, layout.slot_token)
    h = mosaic.gate_up(xs, weights.gate, weights.up, layout.tile_expert, layout.num_tiles, act=act, cfg=up_tiles,
                       interpret=interpret)
    y = mosaic.down(h, weights.down, layout.tile_expert, layout.num_tiles, layout.slot_weight, cfg=down_tiles,
                    interpret=interpret)
    return combine_slots(y, layout.pair_slot, interpret=interpret, residual=residual)
