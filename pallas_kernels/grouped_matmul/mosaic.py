"""Prefill-sized grouped matmuls for MoE experts on Hopper's tensor cores (Pallas, Mosaic GPU): TMA and wgmma.

The Triton kernels (`kernel.py`) gather each tile's token rows in the kernel and multiply with `jnp.dot`; at 4,096
tokens they reach under half the dense bf16 matmul rate (the sweep's best tile, `benchmarks/README.md` "moe").
Here the rows come sorted first (`sorted_rows`: one XLA gather of every slot's token row, padding rows zero), so
each row tile is a contiguous block that TMA loads, and each program is a plain pipelined matmul of one row tile
by one column tile of its expert's weight, read through the same TMA pipeline:

  * `gate_up`: program (t, j) multiplies tile t's rows by columns j of its expert's gate and up weights (two
    accumulators fed from one activation tile a step) and stores `act(gate) · up` in the activations' dtype;
  * `down`: the slots' hidden rows times the down weight, each row times its routing weight, stored likewise.

With `MosaicTiles.warp_specialized` a memory warpgroup issues every step's loads while a compute warpgroup per 64
rows of the tile multiplies its rows (each holds only its rows' accumulators, so gate/up tiles can be 128 columns
wide); `DEFAULT_TILES` are warp-specialised, as `scripts/bench_moe_kernels.py --mosaic` timed them fastest. Tiles
past the step's `num_tiles` return at once, and an expert with no rows has no tile, so its weight is never read.
Float weights only (bfloat16 or float16); quantized experts stay on the Triton kernels. The combine back to token
order is `combine.combine_slots`, as for the Triton kernels' sorted layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.swizzle import swizzled

WGMMA_ROWS = 64  # one warpgroup's wgmma rows: a row tile is a multiple of this
MAX_COMPUTE_GROUPS = 2  # warp-specialised: compute warpgroups beside the memory one (registers: 2 × 64 × 128 f32)
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """One launch's tiles: `block_rows` slots a row tile (the routing's padding unit), `block_n` output columns,
    `block_k` inputs a pipeline step, `max_concurrent_steps` steps in flight. Gate/up holds two `[block_rows,
    block_n]` float32 accumulators in one warpgroup's registers, so it takes half down's `block_n` by default."""

    block_rows: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 3
    # A memory warpgroup issues the loads and a compute warpgroup per 64 rows of the tile multiplies them
    # (`emit_pipeline_warp_specialized`): each compute warpgroup holds only its rows' accumulators, so a 128-row
    # gate/up tile can be 128 columns wide, and the loads never wait on the products
    warp_specialized: bool = False


# (gate/up, down). At 9a5661a (an H100, Qwen3-30B-A3B layer, 4,096 tokens) the warp-specialised 128-wide tiles at 4
# steps took 1037 µs against 1100 for the one-warpgroup (64-wide gate/up, 3 steps) pair
DEFAULT_TILES = (MosaicTiles(max_concurrent_steps=4, warp_specialized=True),
                 MosaicTiles(max_concurrent_steps=4, warp_specialized=True))


def fits(d: int, inter: int, tiles: tuple[MosaicTiles, MosaicTiles] = DEFAULT_TILES) -> bool:
    """Whether a layer of hidden size `d` and expert width `inter` takes these tiles (whole tiles along every
    dimension: the kernels mask no edges)."""
    up, down = tiles
    return (up.block_rows == down.block_rows and up.block_rows % WGMMA_ROWS == 0
            and d % up.block_k == 0 and inter % up.block_n == 0 and inter % down.block_k == 0
            and d % down.block_n == 0)


def sorted_rows(x: Float[Array, "tokens d"], slot_token: Int[Array, " slots"]) -> Float[Array, "slots d"]:
    """Each slot's token row of `x`, zeros for padding slots (`slot_token` -1): the row tiles TMA loads."""
    rows = x[jnp.maximum(slot_token, 0)]
    return jnp.where((slot_token >= 0)[:, None], rows, jnp.zeros((), x.dtype))


def _spec(shape: tuple[int, int], index: Callable, dtype) -> plgpu.BlockSpec:
    """A pipeline input read by wgmma: released a step late, since a step leaves its products in flight."""
    return plgpu.BlockSpec(shape, index, transforms=swizzled(dtype, shape[1]), delay_release=1)


def _gate_up_specs(cfg: MosaicTiles, x_ref, w_ref) -> list:
    """The pipeline inputs of a gate/up tile: its rows' activations, then the gate and the up weights' columns."""
    weight = functools.partial(_spec, (cfg.block_k, cfg.block_n), lambda k: (k, 0), w_ref.dtype)
    return [_spec((cfg.block_rows, cfg.block_k), lambda k: (0, k), x_ref.dtype), weight(), weight()]


def _down_specs(cfg: MosaicTiles, h_ref, w_ref) -> list:
    """The pipeline inputs of a down tile: its rows' hidden activations, then the down weight's columns."""
    return [_spec((cfg.block_rows, cfg.block_k), lambda k: (0, k), h_ref.dtype),
            _spec((cfg.block_k, cfg.block_n), lambda k: (k, 0), w_ref.dtype)]


def _routed(product, weight_ref):
    """Each row of `product` times its slot's routing weight (`weight_ref`: the rows' weights, float32)."""
    weight = plgpu.load(weight_ref, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    return product * lax.broadcast_in_dim(weight, product.shape, [0])


def _store(value, o_smem, out_ref) -> None:
    """`value` to `out_ref` through the staging tile `o_smem` and one TMA copy."""
    o_smem[...] = value.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref)
    plgpu.wait_smem_to_gmem(0)


def _tile_of(cfg: MosaicTiles, tile_expert_ref, num_tiles_ref, body: Callable) -> None:
    """Runs `body(expert, rows, cols)` for this program's (row tile, column tile) if the row tile is in use."""
    t, j = lax.axis_index("t"), lax.axis_index("n")
    rows = pl.ds(pl.multiple_of(t * cfg.block_rows, cfg.block_rows), cfg.block_rows)
    cols = pl.ds(pl.multiple_of(j * cfg.block_n, cfg.block_n), cfg.block_n)
    pl.when(t < num_tiles_ref[0])(lambda: body(tile_expert_ref[t], rows, cols))


def _gate_up_program(x_ref, wg_ref, wu_ref, tile_expert_ref, num_tiles_ref, h_ref, o_smem, *, cfg: MosaicTiles,
                     act: Callable):
    k_dim = x_ref.shape[1]

    def tile(e, rows, cols):
        def accumulate(gate_acc, up_acc):
            def step(_, x_smem, g_smem, u_smem):
                plgpu.wgmma(gate_acc, x_smem, g_smem)
                plgpu.wgmma(up_acc, x_smem, u_smem)
                plgpu.wgmma_wait(2)  # this step's two products stay in flight; the last step's are done

            plgpu.emit_pipeline(
                step, grid=(k_dim // cfg.block_k,), max_concurrent_steps=cfg.max_concurrent_steps,
                in_specs=_gate_up_specs(cfg, x_ref, wg_ref),
            )(x_ref.at[rows], wg_ref.at[e, :, cols], wu_ref.at[e, :, cols])
            plgpu.wgmma_wait(0)
            return act(gate_acc[...]) * up_acc[...]

        acc = plgpu.ACC((cfg.block_rows, cfg.block_n), jnp.float32)
        _store(pl.run_scoped(accumulate, acc, acc), o_smem, h_ref.at[rows, cols])

    _tile_of(cfg, tile_expert_ref, num_tiles_ref, tile)


def _own_rows():
    """A compute warpgroup's 64 rows of the tile (warp-specialised programs)."""
    return pl.ds(pl.multiple_of(lax.axis_index("wg") * WGMMA_ROWS, WGMMA_ROWS), WGMMA_ROWS)


def _store_own(value, o_smem, out_ref) -> None:
    """A compute warpgroup's rows of the tile (`out_ref`) out through its part of the staging tile."""
    own = _own_rows()
    _store(value, o_smem.at[own], out_ref.at[own])


def _specialized(step, compute, cfg: MosaicTiles, k_dim: int, in_specs: list):
    return plgpu.emit_pipeline_warp_specialized(
        step, grid=(k_dim // cfg.block_k,), memory_registers=40, in_specs=in_specs, wg_axis="wg",
        num_compute_wgs=cfg.block_rows // WGMMA_ROWS,
        max_concurrent_steps=min(cfg.max_concurrent_steps, k_dim // cfg.block_k), compute_context=compute)


def _gate_up_specialized(x_ref, wg_ref, wu_ref, tile_expert_ref, num_tiles_ref, h_ref, o_smem, *, cfg: MosaicTiles,
                         act: Callable):
    """`_gate_up_program` with the loads on a memory warpgroup and each compute warpgroup's 64 rows apart."""
    k_dim = x_ref.shape[1]

    def tile(e, rows, cols):
        def step(_, x_smem, g_smem, u_smem, accs):
            own = x_smem.at[_own_rows()]
            plgpu.wgmma(accs[0], own, g_smem)
            plgpu.wgmma(accs[1], own, u_smem)
            plgpu.wgmma_wait(2)  # this step's two products stay in flight; the last step's are done
            return accs

        def compute(run):
            def accumulate(gate_acc, up_acc):
                run((gate_acc, up_acc))
                plgpu.wgmma_wait(0)
                return act(gate_acc[...]) * up_acc[...]

            acc = plgpu.ACC((WGMMA_ROWS, cfg.block_n), jnp.float32)
            _store_own(pl.run_scoped(accumulate, acc, acc), o_smem, h_ref.at[rows, cols])

        _specialized(step, compute, cfg, k_dim, _gate_up_specs(cfg, x_ref, wg_ref))(
            x_ref.at[rows], wg_ref.at[e, :, cols], wu_ref.at[e, :, cols])

    _tile_of(cfg, tile_expert_ref, num_tiles_ref, tile)


def _down_specialized(h_ref, w_ref, tile_expert_ref, num_tiles_ref, weight_ref, y_ref, o_smem, *, cfg: MosaicTiles):
    """`_down_program` with the loads on a memory warpgroup and each compute warpgroup's 64 rows apart."""
    k_dim = h_ref.shape[1]

    def tile(e, rows, cols):
        def step(_, h_smem, w_smem, acc):
            plgpu.wgmma(acc, h_smem.at[_own_rows()], w_smem)
            plgpu.wgmma_wait(1)
            return acc

        def compute(run):
            def accumulate(acc):
                run(acc)
                plgpu.wgmma_wait(0)
                return acc[...]

            product = pl.run_scoped(accumulate, plgpu.ACC((WGMMA_ROWS, cfg.block_n), jnp.float32))
            _store_own(_routed(product, weight_ref.at[rows].at[_own_rows()]), o_smem, y_ref.at[rows, cols])

        _specialized(step, compute, cfg, k_dim, _down_specs(cfg, h_ref, w_ref))(h_ref.at[rows], w_ref.at[e, :, cols])

    _tile_of(cfg, tile_expert_ref, num_tiles_ref, tile)


def _down_program(h_ref, w_ref, tile_expert_ref, num_tiles_ref, weight_ref, y_ref, o_smem, *, cfg: MosaicTiles):
    k_dim = h_ref.shape[1]

    def tile(e, rows, cols):
        def accumulate(acc):
            def step(_, h_smem, w_smem):
                plgpu.wgmma(acc, h_smem, w_smem)
                plgpu.wgmma_wait(1)

            plgpu.emit_pipeline(
                step, grid=(k_dim // cfg.block_k,), max_concurrent_steps=cfg.max_concurrent_steps,
                in_specs=_down_specs(cfg, h_ref, w_ref),
            )(h_ref.at[rows], w_ref.at[e, :, cols])
            plgpu.wgmma_wait(0)
            return acc[...]

        product = pl.run_scoped(accumulate, plgpu.ACC((cfg.block_rows, cfg.block_n), jnp.float32))
        _store(_routed(product, weight_ref.at[rows]), o_smem, y_ref.at[rows, cols])

    _tile_of(cfg, tile_expert_ref, num_tiles_ref, tile)


def _check(name: str, rows: int, k_dim: int, n_dim: int, weight_dtype, act_dtype, cfg: MosaicTiles) -> None:
    if jnp.dtype(weight_dtype) not in FLOAT_DTYPES or jnp.dtype(weight_dtype) != jnp.dtype(act_dtype):
        raise ValueError(f"{name}: the Mosaic GPU experts take bfloat16 or float16 weights of the activations' "
                         f"dtype (got {weight_dtype} weights, {act_dtype} activations)")
    if rows % cfg.block_rows or cfg.block_rows % WGMMA_ROWS or k_dim % cfg.block_k or n_dim % cfg.block_n:
        raise ValueError(f"{name}: {rows} slots, K {k_dim} and N {n_dim} must be whole tiles of {cfg} (row tiles a "
                         f"multiple of {WGMMA_ROWS})")
    if cfg.warp_specialized and cfg.block_rows > MAX_COMPUTE_GROUPS * WGMMA_ROWS:
        raise ValueError(f"{name}: warp-specialised tiles of at most {MAX_COMPUTE_GROUPS * WGMMA_ROWS} rows (a "
                         f"compute warpgroup's registers per {WGMMA_ROWS}), not {cfg.block_rows}")


def _launch(program, out_shape, cfg: MosaicTiles, n_dim: int, interpret: bool):
    threads = dict(num_threads=cfg.block_rows // WGMMA_ROWS + 1, thread_name="wg") if cfg.warp_specialized else {}
    return plgpu.kernel(
        program, out_type=out_shape, grid=(out_shape.shape[0] // cfg.block_rows, n_dim // cfg.block_n),
        grid_names=("t", "n"), scratch_types=[plgpu.SMEM((cfg.block_rows, cfg.block_n), out_shape.dtype,
                                                          transforms=swizzled(out_shape.dtype, cfg.block_n))],
        interpret=plgpu.InterpretGPUParams() if interpret else None, **threads)


@functools.partial(jax.jit, static_argnames=("act", "cfg", "interpret"))
def gate_up(
    xs: Float[Array, "slots d"], w_gate: Float[Array, "experts d inter"], w_up: Float[Array, "experts d inter"],
    tile_expert: Int[Array, " tiles"], num_tiles: Int[Array, " 1"], *, act: Callable, cfg: MosaicTiles,
    interpret: bool = False,
) -> Float[Array, "slots inter"]:
    """`act(xs·W_gate[e]) · (xs·W_up[e])` for every row tile in use (`e`: its expert); rows of tiles past
    `num_tiles` are left unwritten (never read). `interpret`: Mosaic GPU's interpreter (CPU tests)."""
    inter = w_gate.shape[2]
    _check("gate_up", xs.shape[0], xs.shape[1], inter, w_gate.dtype, xs.dtype, cfg)
    program = functools.partial(_gate_up_specialized if cfg.warp_specialized else _gate_up_program, cfg=cfg, act=act)
    out = jax.ShapeDtypeStruct((xs.shape[0], inter), xs.dtype)
    return _launch(program, out, cfg, inter, interpret)(
        xs, w_gate, w_up, tile_expert, num_tiles)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def down(
    h: Float[Array, "slots inter"], w_down: Float[Array, "experts inter d"], tile_expert: Int[Array, " tiles"],
    num_tiles: Int[Array, " 1"], slot_weight: Float[Array, " slots"], *, cfg: MosaicTiles, interpret: bool = False,
) -> Float[Array, "slots d"]:
    """Each slot's hidden row times its tile's expert's down weight, times the slot's routing weight (float32;
    padding slots carry 0), for every row tile in use."""
    d = w_down.shape[2]
    _check("down", h.shape[0], h.shape[1], d, w_down.dtype, h.dtype, cfg)
    program = functools.partial(_down_specialized if cfg.warp_specialized else _down_program, cfg=cfg)
    out = jax.ShapeDtypeStruct((h.shape[0], d), h.dtype)
    return _launch(program, out, cfg, d, interpret)(
        h, w_down, tile_expert, num_tiles, slot_weight.astype(jnp.float32))
