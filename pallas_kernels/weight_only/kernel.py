"""Few-row matmul with integer weights on Hopper's tensor cores (Pallas, Mosaic GPU backend): `x @ ((q − z) · s)ᵀ`.

`q [n, k]` holds signed 4- or 8-bit integers (output feature n's input weights contiguous, as checkpoints store
them), `s [g, n]` one scale per group of `k / g` inputs and output feature, `z [g, n]` optional zero points (whole
numbers, in q's signed units: an AWQ zero point z' of unsigned nibbles is z' − 8), subtracted from the upcast
weights in registers (exact in bfloat16: |q − z| ≤ 15 for int4). Decode multiplies few rows by a large
weight, so the weight's bytes set the time: the kernel streams each weight tile once through TMA into shared
memory, upcasts it in registers (Mosaic's int4 → bf16 path: a few bit operations per pair of weights), and runs
`wgmma` with the *weight* as the 64-row left operand and the activation rows as the 8-to-256-column right one, so
the tensor cores' minimum tile is spent on output features, not on padding tokens.

A program owns `TILE_N = 64` output features and one of `splits` consecutive ranges of input steps: each pipeline
step (`block_k` inputs, inside one group) goes into a fresh accumulator and is scaled by its group's 64 scales
before it is added to the running sum (float32), so a scale costs a multiply per output, not per weight. Splits
write float32 partial sums that the caller adds (XLA), so that a short weight (the attention output projection:
64 column tiles) still gives every SM work.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Integer

TILE_N = 64  # output features a program owns: one warpgroup's wgmma rows
MAX_ROWS = 256  # wgmma's widest right operand
WEIGHT_DTYPES = (jnp.dtype(jnp.int4), jnp.dtype(jnp.int8))


@dataclasses.dataclass(frozen=True)
class WeightOnlyConfig:
    """`max_concurrent_steps`: weight tiles in flight per program. `min_programs`: split the groups until the grid
    has at least this many programs (0: never). `staged`: the upcast tile goes through shared memory to wgmma (the
    form Mosaic GPU's interpreter runs; its wgmma takes shared-memory operands only)."""

    block_k: int = 128
    max_concurrent_steps: int = 4
    min_programs: int = 264
    staged: bool = False


def padded_rows(m: int) -> int:
    """wgmma's right operand is a multiple of 8 columns."""
    return max(8, -(-m // 8) * 8)


def splits_for(groups: int, tiles: int, min_programs: int) -> int:
    """The fewest splits of `groups` (a divisor of it) giving at least `min_programs` programs."""
    for split in range(1, groups + 1):
        if groups % split == 0 and split * tiles >= min_programs:
            return split
    return groups


def _swizzled(dtype, minor: int) -> tuple:
    bits = jnp.dtype(dtype).itemsize * 8 if dtype != jnp.int4 else 4
    swizzle = plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def check(m: int, k: int, n: int, groups: int, dtype, block_k: int) -> None:
    if jnp.dtype(dtype) not in WEIGHT_DTYPES:
        raise ValueError(f"the weight-only kernel takes int4 or int8 weights, not {dtype}")
    if n % TILE_N or k % groups or (k // groups) % block_k or block_k % 64 or m > MAX_ROWS:
        raise ValueError(f"the weight-only kernel needs n ({n}) a multiple of {TILE_N}, groups of a multiple of "
                         f"{block_k} inputs (k {k}, {groups} groups; block_k a multiple of 64) and at most "
                         f"{MAX_ROWS} rows (got {m})")


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def weight_only_matmul(
    x: Float[Array, "m k"], q: Integer[Array, "n k"], scales: Float[Array, "g n"],
    zeros: Float[Array, "g n"] | None = None, *, config: WeightOnlyConfig = WeightOnlyConfig(), interpret=None,
) -> Float[Array, "m n"]:
    """`x @ ((q − zeros[group]) · scales[group])ᵀ` in x's dtype (float32 accumulation). `interpret`: Mosaic GPU's
    interpreter parameters (`plgpu.InterpretGPUParams`), for the CPU (needs `config.staged`)."""
    m, k = x.shape
    n = q.shape[0]
    groups = scales.shape[0]
    block_k = config.block_k
    check(m, k, n, groups, q.dtype, block_k)
    rows = padded_rows(m)
    tiles = n // TILE_N
    split = splits_for(k // block_k, tiles, config.min_programs)
    xp = jnp.pad(x.astype(jnp.bfloat16), ((0, rows - m), (0, 0)))
    kernel = plgpu.kernel(
        functools.partial(_program, block_k=block_k, steps=k // block_k // split, group=k // groups,
                          zero_points=zeros is not None, config=config),
        out_type=jax.ShapeDtypeStruct((split, n, rows), jnp.float32),
        grid=(tiles, split),
        grid_names=("tile", "split"),
        scratch_types=_scratch(rows, block_k, config),
        interpret=interpret,
    )
    operands = (q, xp, scales.astype(jnp.float32)) + (() if zeros is None else (zeros.astype(jnp.bfloat16),))
    parts = kernel(*operands)
    return jnp.sum(parts, axis=0)[:, :m].T.astype(x.dtype)


def _scratch(rows: int, block_k: int, config: WeightOnlyConfig) -> list:
    out = [plgpu.SMEM((TILE_N, rows), jnp.float32)]
    if config.staged:
        out.append(plgpu.SMEM((TILE_N, block_k), jnp.bfloat16, transforms=_swizzled(jnp.bfloat16, block_k)))
    return out


def _program(q_ref, x_ref, s_ref, *refs, block_k: int, steps: int, group: int, zero_points: bool,
             config: WeightOnlyConfig):
    z_ref = refs[0] if zero_points else None
    out_ref, out_smem, *staged = refs[1:] if zero_points else refs
    tile, split = lax.axis_index("tile"), lax.axis_index("split")
    n0 = pl.multiple_of(tile * TILE_N, TILE_N)
    rows = x_ref.shape[0]
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def step(indices, q_smem, x_smem, total):
        (i,) = indices
        g = (split * steps + i) // (group // block_k)
        scale = plgpu.load(s_ref.at[g, pl.ds(n0, TILE_N)], layout=row_layout, optimized=False)
        w = _upcast(q_smem)
        if z_ref is not None:
            zero = plgpu.load(z_ref.at[g, pl.ds(n0, TILE_N)], layout=row_layout, optimized=False)
            w = w - lax.broadcast_in_dim(zero, w.shape, [0])

        def product(acc_ref):
            if staged:
                staged[0][...] = w
                plgpu.commit_smem()
                plgpu.wgmma(acc_ref, staged[0], x_smem.T)
            else:
                plgpu.wgmma(acc_ref, w, x_smem.T)
            return acc_ref[...]

        part = pl.run_scoped(product, plgpu.ACC((TILE_N, rows), jnp.float32))
        return total + part * lax.broadcast_in_dim(scale, part.shape, [0])

    pipeline = plgpu.emit_pipeline(
        step,
        grid=(steps,),
        in_specs=[
            plgpu.BlockSpec((TILE_N, block_k), lambda i: (0, i), transforms=_swizzled(q_ref.dtype, block_k)),
            plgpu.BlockSpec((rows, block_k), lambda i: (0, i), transforms=_swizzled(jnp.bfloat16, block_k)),
        ],
        max_concurrent_steps=min(config.max_concurrent_steps, steps),
        init_carry=plgpu.layout_cast(jnp.zeros((TILE_N, rows), jnp.float32), plgpu.Layout.WGMMA),
    )
    k_range = pl.ds(split * steps * block_k, steps * block_k)
    total = pipeline(q_ref.at[pl.ds(n0, TILE_N), k_range], x_ref.at[:, k_range])
    out_smem[...] = total
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[split, pl.ds(n0, TILE_N)])
    plgpu.wait_smem_to_gmem(0)


def _upcast(q_smem):
    """The weight tile as bfloat16 for wgmma's left operand (the layouts are Mosaic's to infer: it picks the load
    its integer-to-bf16 conversion and the operand's layout agree on)."""
    return q_smem[...].astype(jnp.bfloat16)
