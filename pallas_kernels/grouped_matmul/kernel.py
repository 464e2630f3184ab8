"""Grouped (per-expert) matmuls for mixture-of-experts layers on NVIDIA GPUs (Pallas, Triton backend).

The rows come laid out by `routing.expert_tiles`: tile `t` of `block_rows` slots belongs to expert
`tile_expert[t]`, and slot `s` holds token `slot_token[s]` (-1: padding). Program `(t, j)` multiplies its tile's
rows by columns `j` of that one expert's weight, so a weight tile is read once per tile, tiles past `num_tiles`
return at once, and an expert nobody routed to is never read: at batch 1 only the k routed experts' bytes move.

Two launches per MoE layer:
  * `expert_gate_up`: gathers its tokens' rows straight from the activations (no sorted copy of them), multiplies by
    the gate and the up weight in one pass over K (the row tile loaded once for both), and writes
    `act(gate) * up` for its slots;
  * `expert_down`: the slots' hidden rows times the down weight, scaled by each slot's routing weight.
The combine back to token order (a sum of k rows per token) is one gather in `routing.combine`.

Weights may be stored in a narrower type than the activations (float8, int8) with a per-(expert, output column)
scale applied to the float32 accumulator, so quantized experts reuse the same kernels; `None` means unscaled.
`precision` is `jnp.dot`'s: HIGHEST makes float32 products exact (IEEE) instead of TF32.

Triton rules (JAX-PALLAS.md §1.2): power-of-two tiles, ragged edges masked, block-table-style indices loaded in
the kernel, no scratch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr
from jaxtyping import Array, Float, Int

from pallas_kernels.grouped_matmul.routing import ExpertTiles


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Static tile sizes of one launch; `block_rows` must match the routing's."""

    block_rows: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4


def _arange(start, size: int):
    return start + jnp.arange(size, dtype=jnp.int32)


def _tile_rows(slot_token_ref, t, block_rows: int):
    """This tile's slots, their tokens (clamped to 0 for padding) and which of them are real."""
    slots = _arange(t * block_rows, block_rows)
    token = pltr.load(slot_token_ref.at[slots])
    return slots, jnp.maximum(token, 0), token >= 0


def _weight_tile(w_ref, e, ks, cols, k_dim: int, n_dim: int, dtype, cfg: TileConfig):
    """One expert's `[block_k, block_n]` weight tile in the compute dtype. Edges are masked only where the shape
    has them (static), and masked lanes zeroed after the cast: Triton cannot splat a fill value into float8."""
    index = w_ref.at[e, ks[:, None], cols[None, :]]
    if k_dim % cfg.block_k == 0 and n_dim % cfg.block_n == 0:
        return pltr.load(index).astype(dtype)
    mask = (ks[:, None] < k_dim) & (cols[None, :] < n_dim)
    return jnp.where(mask, pltr.load(index, mask=mask).astype(dtype), 0)


def _column_scale(scale_ref, e, cols, n_dim: int):
    if scale_ref is None:
        return None
    return pltr.load(scale_ref.at[e, cols], mask=cols < n_dim, other=0.0)[None, :]


def _gate_up_kernel(x_ref, wg_ref, wu_ref, sg_ref, su_ref, slot_token_ref, tile_expert_ref, num_tiles_ref, h_ref, *,
                    cfg: TileConfig, act: Callable, precision):
    t, j = pl.program_id(0), pl.program_id(1)
    k_dim, n_dim = wg_ref.shape[1], wg_ref.shape[2]

    @pl.when(t < num_tiles_ref[0])
    def _():
        e = tile_expert_ref[t]
        slots, token, real = _tile_rows(slot_token_ref, t, cfg.block_rows)
        cols = _arange(j * cfg.block_n, cfg.block_n)

        def step(i, acc):
            ks = _arange(i * cfg.block_k, cfg.block_k)
            x = pltr.load(x_ref.at[token[:, None], ks[None, :]], mask=real[:, None] & (ks[None, :] < k_dim), other=0)
            gate = jnp.dot(x, _weight_tile(wg_ref, e, ks, cols, k_dim, n_dim, x.dtype, cfg),
                           preferred_element_type=jnp.float32, precision=precision)
            up = jnp.dot(x, _weight_tile(wu_ref, e, ks, cols, k_dim, n_dim, x.dtype, cfg),
                         preferred_element_type=jnp.float32, precision=precision)
            return acc[0] + gate, acc[1] + up

        zeros = jnp.zeros((cfg.block_rows, cfg.block_n), jnp.float32)
        gate, up = lax.fori_loop(0, pl.cdiv(k_dim, cfg.block_k), step, (zeros, zeros))
        if sg_ref is not None:
            gate, up = gate * _column_scale(sg_ref, e, cols, n_dim), up * _column_scale(su_ref, e, cols, n_dim)
        h = act(gate) * up
        pltr.store(h_ref.at[slots[:, None], cols[None, :]], h.astype(h_ref.dtype), mask=cols[None, :] < n_dim)


def _down_kernel(h_ref, wd_ref, sd_ref, slot_weight_ref, tile_expert_ref, num_tiles_ref, y_ref, *, cfg: TileConfig,
                 precision):
    t, j = pl.program_id(0), pl.program_id(1)
    k_dim, n_dim = wd_ref.shape[1], wd_ref.shape[2]

    @pl.when(t < num_tiles_ref[0])
    def _():
        e = tile_expert_ref[t]
        slots = _arange(t * cfg.block_rows, cfg.block_rows)
        cols = _arange(j * cfg.block_n, cfg.block_n)

        def step(i, acc):
            ks = _arange(i * cfg.block_k, cfg.block_k)
            h = pltr.load(h_ref.at[slots[:, None], ks[None, :]], mask=ks[None, :] < k_dim, other=0)
            return acc + jnp.dot(h, _weight_tile(wd_ref, e, ks, cols, k_dim, n_dim, h.dtype, cfg),
                                 preferred_element_type=jnp.float32, precision=precision)

        acc = lax.fori_loop(0, pl.cdiv(k_dim, cfg.block_k), step,
                            jnp.zeros((cfg.block_rows, cfg.block_n), jnp.float32))
        if sd_ref is not None:
            acc = acc * _column_scale(sd_ref, e, cols, n_dim)
        weight = pltr.load(slot_weight_ref.at[slots])
        pltr.store(y_ref.at[slots[:, None], cols[None, :]], (acc * weight[:, None]).astype(y_ref.dtype),
                   mask=cols[None, :] < n_dim)


def _launch(kernel, operands, out_shape, rows: int, n_dim: int, cfg: TileConfig, interpret: bool, name: str):
    return pl.pallas_call(
        kernel,
        grid=(rows // cfg.block_rows, pl.cdiv(n_dim, cfg.block_n)),
        in_specs=[pl.no_block_spec] * len(operands),
        out_specs=pl.no_block_spec,
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=name,
    )(*operands)


def _optional(kernel, present: tuple[bool, ...]):
    """Binds the kernel's optional scale refs to None where absent (pallas_call takes arrays only)."""
    def bound(*refs):
        refs = list(refs)
        full = [refs.pop(0) if here else None for here in present] + refs
        return kernel(*full)
    return bound


@functools.partial(jax.jit, static_argnames=("act", "cfg", "interpret", "precision"))
def expert_gate_up(
    x: Float[Array, "tokens d"], w_gate: Float[Array, "experts d inter"], w_up: Float[Array, "experts d inter"],
    tiles: ExpertTiles, *, act: Callable, cfg: TileConfig, interpret: bool = False, precision=None,
    gate_scale: Float[Array, "experts inter"] | None = None, up_scale: Float[Array, "experts inter"] | None = None,
) -> Float[Array, "slots inter"]:
    """`act(x·W_gate[e]) * (x·W_up[e])` for every slot's token and expert (padding slots: zeros, never read)."""
    slots, inter = tiles.slot_token.shape[0], w_gate.shape[2]
    if (gate_scale is None) != (up_scale is None):
        raise ValueError("gate and up weights are scaled both or neither")
    scales = () if gate_scale is None else (gate_scale, up_scale)
    kernel = functools.partial(_gate_up_kernel, cfg=cfg, act=act, precision=precision)
    kernel = _optional(kernel, (True,) * 3 + (bool(scales),) * 2)
    operands = (x, w_gate, w_up, *scales, tiles.slot_token, tiles.tile_expert, tiles.num_tiles)
    return _launch(kernel, operands, jax.ShapeDtypeStruct((slots, inter), x.dtype), slots, inter, cfg, interpret,
                   "expert_gate_up")


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "precision"))
def expert_down(
    h: Float[Array, "slots inter"], w_down: Float[Array, "experts inter d"], tiles: ExpertTiles, *, cfg: TileConfig,
    interpret: bool = False, precision=None, down_scale: Float[Array, "experts d"] | None = None,
) -> Float[Array, "slots d"]:
    """Each slot's hidden row times its expert's down weight, times its routing weight."""
    slots, d = h.shape[0], w_down.shape[2]
    kernel = functools.partial(_down_kernel, cfg=cfg, precision=precision)
    kernel = _optional(kernel, (True, True, down_scale is not None))
    operands = (h, w_down, *(() if down_scale is None else (down_scale,)), tiles.slot_weight, tiles.tile_expert,
                tiles.num_tiles)
    return _launch(kernel, operands, jax.ShapeDtypeStruct((slots, d), h.dtype), slots, d, cfg, interpret,
                   "expert_down")
