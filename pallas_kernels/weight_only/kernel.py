"""Few-row matmul with 4- and 8-bit weights on Hopper's tensor cores (Pallas, Mosaic GPU): `x @ ((q − z) · s)ᵀ`.

`q [n, k]` holds signed 4- or 8-bit integers or float8 e4m3 values (output feature n's inputs contiguous, as
checkpoints store them), `s [g, n]` one scale per group of `k / g` inputs and output feature, `z [g, n]` optional
zero points (in q's signed units: an AWQ zero point z' of unsigned nibbles is z' − 8), subtracted from the upcast
weights in registers (exact in bfloat16 for whole numbers and eighths: |q − z| < 16 for int4). Decode multiplies few
rows by a large weight, so the weight's bytes set the time: the kernel streams each weight tile once through TMA
into shared memory, upcasts it in registers (Mosaic picks the layouts: its int4 → bf16 path is a few bit operations
per pair of weights; float8 goes to float16, see `F16_ROW_MAX`), and runs `wgmma` with the *weight* as the 64-row
left operand and the activation rows as the 8-to-256-column right one, so the tensor cores' minimum tile is spent on
output features, not on padding tokens.

A program owns `tile_n` (64 or 128) output features and one of `splits` consecutive ranges of input steps. Each
pipeline step TMA-loads `block_k` inputs of the weight and the activations, and the group scales (and zero points)
they need, so no step waits on a global load; each group's part of a step (a chunk) goes into a fresh accumulator
and is scaled by its group's scales before it is added to the running sum (float32), so a scale costs a multiply
per output, not per weight. Splits write float32 partial sums that the caller adds (XLA), so that a short weight
(the attention output projection: 64 column tiles) still gives every SM work.
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
WEIGHT_DTYPES = (jnp.dtype(jnp.int4), jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
# float8 e4m3 upcasts natively to float16 only (not to bfloat16: JAX-PALLAS.md), so its products run in float16,
# the activations scaled per row into float16's range first (their largest magnitude to this) and back after
F16_ROW_MAX = 2.0 ** 14
RESIDENT_X_BYTES = 64 * 1024  # a program's whole activation range in shared memory, at most


@dataclasses.dataclass(frozen=True)
class WeightOnlyConfig:
    """`tile_n`: output features a program owns (64 or 128: one or two wgmma row tiles). `block_k`: inputs a pipeline
    step loads (a step wider than a group multiplies each group's part apart). `max_concurrent_steps`: steps in
    flight per program. `min_programs`: split the steps until the grid has at least this many programs (0: never).
    `staged`: the upcast tile goes through shared memory to wgmma (the form Mosaic GPU's interpreter runs; its wgmma
    takes shared-memory operands only). `resident_x`: a program loads its whole range of the activations once, at
    its start, instead of a slice with every step (for few rows the slices are a third of an int4 step's bytes); a
    range over `RESIDENT_X_BYTES` keeps the slices. `one_accumulator`: the products of a program's whole range go into
    one accumulator, each group's scale multiplied into its weights in registers first (bfloat16: a rounding of the
    scaled weight, as in a bfloat16 model's own weights) and per-channel scales applied after the kernel, so the
    tensor cores' products are never awaited inside the loop (one in flight while the next tile is upcast).
    `warp_specialized`: a memory warpgroup issues the loads and a compute warpgroup per 64 output features upcasts
    and multiplies (per-chunk scaling; neither resident activations nor one accumulator). `persistent`: a grid of at
    most this many programs (the SMs, or a multiple), each running its share of the (tile, split) work items back
    to back through one pipeline, so loads keep flowing across items and each item's result leaves asynchronously
    (per-chunk scaling, one warpgroup; 0: a program per work item)."""

    tile_n: int = 64
    block_k: int = 128
    max_concurrent_steps: int = 4
    min_programs: int = 264
    staged: bool = False
    resident_x: bool = False
    one_accumulator: bool = False
    warp_specialized: bool = False
    persistent: int = 0


def default_config(rows: int) -> WeightOnlyConfig:
    """The fastest of the probe's configurations on an H100 (`scripts/probe_weight_only_gpu.py`, 8 Llama-3.1-8B
    layers' projections): 256-input steps, 64-feature tiles; a decode row keeps more steps in flight and more
    programs (each moves few bytes)."""
    if rows <= 8:
        return WeightOnlyConfig(tile_n=64, block_k=256, max_concurrent_steps=8, min_programs=528)
    return WeightOnlyConfig(tile_n=64, block_k=256, max_concurrent_steps=4, min_programs=264)


def padded_rows(m: int) -> int:
    """wgmma's right operand is a multiple of 8 columns."""
    return max(8, -(-m // 8) * 8)


def _whole_splits(steps: int, steps_per_group: int) -> list[int]:
    """The divisors of `steps` whose ranges hold whole groups or lie inside one (`steps_per_group` steps a group; 1
    where a step holds whole groups), fewest splits first; `steps` itself always qualifies."""
    return [split for split in range(1, steps + 1) if steps % split == 0
            and ((steps // split) % steps_per_group == 0 or steps_per_group % (steps // split) == 0)]


def splits_for(steps: int, tiles: int, min_programs: int, steps_per_group: int = 1) -> int:
    """The fewest splits of `steps` giving at least `min_programs` programs (`_whole_splits`), else `steps`."""
    return next((split for split in _whole_splits(steps, steps_per_group) if split * tiles >= min_programs), steps)


def persistent_splits(steps: int, tiles: int, programs: int, steps_per_group: int = 1) -> int:
    """The fewest splits of `steps` whose work items (`tiles` × splits) keep 90 % of `programs` busy in every wave
    (else the busiest), each split whole groups or inside one."""
    def busy(split):
        items = tiles * split
        return items / (-(-items // programs) * programs)

    valid = _whole_splits(steps, steps_per_group)
    return next((split for split in valid if busy(split) >= 0.9), max(valid, key=busy))


def _bits(dtype) -> int:
    return 4 if jnp.dtype(dtype) == jnp.int4 else jnp.dtype(dtype).itemsize * 8


def _swizzled(dtype, minor: int, chunk: int) -> tuple:
    """Tiling and swizzle of a `[rows, minor]` shared-memory tile read in column chunks of `chunk` (each chunk whole
    tiles, so that it can be sliced off for its own wgmma)."""
    bits = _bits(dtype)
    swizzle = plgpu.find_swizzle(min(minor, chunk) * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def fits(k: int, n: int, group: int) -> bool:
    """Whether a `[n, k]` weight with groups of `group` inputs (`k` for per-channel scales) takes the kernel's tiles
    as the layers call it: 64 output features, groups of whole 128-input steps."""
    return n % TILE_N == 0 and group % 128 == 0 and k % group == 0


def fit(config: WeightOnlyConfig, k: int, n: int, group: int) -> WeightOnlyConfig:
    """`config` with its tile and step narrowed where a weight's shape needs it (64 output features; a step of one
    group, or of 128 inputs)."""
    tile_n = config.tile_n if n % config.tile_n == 0 else TILE_N
    block_k = config.block_k
    if k % block_k or (group % block_k and block_k % group):
        block_k = min(group, 128)
    return dataclasses.replace(config, tile_n=tile_n, block_k=block_k)


def fitted_matmul(x: Float[Array, "m k"], q: Integer[Array, "n k"], scales: Float[Array, "g n"],
                  zeros: Float[Array, "g n"] | None = None, *, config: WeightOnlyConfig | None = None,
                  interpret: bool = False) -> Float[Array, "m n"]:
    """`weight_only_matmul` as a layer calls it: `config` (None: `default_config(rows)`) narrowed to the weight's
    shape (`fit`); `interpret`: in Mosaic GPU's interpreter, in the shared-memory form it runs (CPU tests)."""
    n, k = q.shape
    config = fit(config or default_config(x.shape[0]), k, n, k // scales.shape[0])
    if interpret:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        return weight_only_matmul(x, q, scales, zeros, config=dataclasses.replace(config, staged=True, min_programs=0),
                                  interpret=plgpu.InterpretGPUParams())
    return weight_only_matmul(x, q, scales, zeros, config=config)


def check(m: int, k: int, n: int, groups: int, dtype, config: WeightOnlyConfig) -> None:
    if jnp.dtype(dtype) not in WEIGHT_DTYPES:
        raise ValueError(f"the weight-only kernel takes int4, int8 or float8_e4m3fn weights, not {dtype}")
    group, block_k = (k // groups if groups and k % groups == 0 else 0), config.block_k
    if (config.tile_n not in (TILE_N, 2 * TILE_N) or n % config.tile_n or not group or group % 64
            or (group % block_k and block_k % group) or k % block_k or block_k % 64 or m > MAX_ROWS):
        raise ValueError(f"the weight-only kernel needs n ({n}) a multiple of its tile ({config.tile_n}), k ({k}) "
                         f"whole groups ({groups}) of a multiple of 64 inputs that divide or are multiples of its "
                         f"step ({block_k}), and at most {MAX_ROWS} rows (got {m})")
    forms = (config.resident_x, config.one_accumulator, config.warp_specialized, config.persistent > 0)
    if (config.warp_specialized or config.persistent) and sum(forms) > 1:
        raise ValueError("warp specialization and persistent programs take no other form (resident activations, "
                         f"one accumulator, each other): {config}")


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def weight_only_matmul(
    x: Float[Array, "m k"], q: Integer[Array, "n k"], scales: Float[Array, "g n"],
    zeros: Float[Array, "g n"] | None = None, *, config: WeightOnlyConfig | None = None, interpret=None,
) -> Float[Array, "m n"]:
    """`x @ ((q − zeros[group]) · scales[group])ᵀ` in x's dtype (float32 accumulation; scales and zero points in
    any float dtype, read as stored). `config` None: `default_config(rows)`. `interpret`: Mosaic GPU's interpreter
    parameters (`plgpu.InterpretGPUParams`), for the CPU (needs `config.staged`)."""
    m, k = x.shape
    n = q.shape[0]
    groups = scales.shape[0]
    config = config or default_config(m)
    check(m, k, n, groups, q.dtype, config)
    rows = padded_rows(m)
    steps = k // config.block_k
    steps_per_group = max(1, k // groups // config.block_k)
    split = (persistent_splits(steps, n // config.tile_n, config.persistent, steps_per_group) if config.persistent
             else splits_for(steps, n // config.tile_n, config.min_programs, steps_per_group))
    span = k // split
    resident = config.resident_x and rows * span * jnp.dtype(compute_dtype(q.dtype)).itemsize <= RESIDENT_X_BYTES
    geo = _Geometry(rows, config.tile_n, config.block_k, k // groups, config.staged, compute_dtype(q.dtype),
                    span if resident else 0, config.one_accumulator, config.one_accumulator and groups > 1)
    if geo.compute == jnp.float16:
        row_scale = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1), 1e-30) / F16_ROW_MAX
        xs = (x.astype(jnp.float32) / row_scale[:, None]).astype(geo.compute)
    else:
        row_scale, xs = None, x.astype(geo.compute)
    xp = jnp.pad(xs, ((0, rows - m), (0, 0)))
    kernel = _kernel(config, geo, steps, split, n, zeros is not None, interpret)
    operands = (q, xp, scales) + (() if zeros is None else (zeros,))  # upcast in registers: no copy a call
    out = jnp.sum(kernel(*operands), axis=0)
    if config.one_accumulator and groups == 1:  # per-channel scales: after the sum, in the same XLA fusion
        out = out * scales[0].astype(jnp.float32)[:, None]
    out = out[:, :m].T
    return (out if row_scale is None else out * row_scale[:, None]).astype(x.dtype)


def _kernel(config: WeightOnlyConfig, geo: "_Geometry", steps: int, split: int, n: int, zero_points: bool,
            interpret):
    """The kernel over `split` ranges of `steps` input steps and `n // tile_n` output tiles: a program per (tile,
    range), warp-specialised or not, or `config.persistent` programs looping over them."""
    out_type = jax.ShapeDtypeStruct((split, n, geo.rows), jnp.float32)
    common = dict(zero_points=zero_points, max_concurrent_steps=config.max_concurrent_steps)
    if config.persistent:
        items = n // config.tile_n * split
        waves = -(-items // config.persistent)
        programs = -(-items // waves)  # the fewest programs for that many waves: at most waves - 1 items repeated
        body = functools.partial(_persistent_program, geo=geo, steps=steps // split, split=split, items=items,
                                 programs=programs, **common)
        return plgpu.kernel(body, out_type=out_type, grid=(programs,), grid_names=("program",),
                            scratch_types=_scratch(geo, slots=2), interpret=interpret)
    threads = dict(num_threads=config.tile_n // TILE_N + 1, thread_name="wg") if config.warp_specialized else {}
    body = functools.partial(_warp_specialized_program if config.warp_specialized else _program, geo=geo,
                             steps=steps // split, **common)
    return plgpu.kernel(body, out_type=out_type, grid=(n // config.tile_n, split), grid_names=("tile", "split"),
                        scratch_types=_scratch(geo, config.warp_specialized), interpret=interpret, **threads)


def compute_dtype(weight_dtype):
    """The dtype the weight is upcast to and the products run in."""
    return jnp.float16 if jnp.dtype(weight_dtype) == jnp.float8_e4m3fn else jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class _Geometry:
    rows: int  # activation rows, padded
    tile_n: int
    block_k: int
    group: int
    staged: bool
    compute: jnp.dtype
    resident_span: int = 0  # inputs of the activations a program holds from its start (0: a slice a step)
    one_accumulator: bool = False
    scaled_weights: bool = False  # one_accumulator with group scales: each group's scale multiplied into its weights

    @property
    def chunk(self) -> int:
        """Inputs per wgmma: the step, or one group of it."""
        return min(self.block_k, self.group)

    @property
    def groups_per_step(self) -> int:
        return max(1, self.block_k // self.group)

    def group_block(self, step):
        """The step's block of `groups_per_step` groups (its index in units of that block)."""
        return step * self.block_k // self.group // self.groups_per_step


def _scratch(geo: _Geometry, warp_specialized: bool = False, slots: int = 0) -> list:
    """The output tile (`slots` of them, where results leave while the next item runs) and staging tiles."""
    out = [plgpu.SMEM(((slots,) if slots else ()) + (geo.tile_n, geo.rows), jnp.float32)]
    if warp_specialized:  # a staging tile per compute warpgroup
        return out + ([plgpu.SMEM((geo.tile_n // TILE_N, TILE_N, geo.chunk), geo.compute,
                                  transforms=_swizzled(geo.compute, geo.chunk, geo.chunk))] if geo.staged else [])
    if geo.resident_span:
        out.append(plgpu.SMEM((geo.rows, geo.resident_span), geo.compute,
                              transforms=_swizzled(geo.compute, geo.block_k, geo.chunk)))
        out.append(plgpu.Barrier())
    if geo.staged:
        out.append(plgpu.SMEM((TILE_N, geo.chunk), geo.compute, transforms=_swizzled(geo.compute, geo.chunk,
                                                                                         geo.chunk)))
    return out


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """What one program's step bodies read: its geometry, its share of the refs, and the activations' resident copy
    (None: the pipeline brings a slice a step)."""

    geo: _Geometry
    first: object  # the program's first K step (traced)
    zero_points: bool
    x_resident: object = None
    x_loaded: object = None
    staged: tuple = ()

    def row(self, ref, group: int, sub: int):
        """One group's scales (or zero points) for row tile `sub`, laid out along the wgmma rows."""
        return plgpu.load(ref.at[group, pl.ds(sub * TILE_N, TILE_N)], layout=plgpu.Layout.WGMMA.reduce(1),
                          optimized=False)

    def x_slice(self, indices, rest):
        """The step's activations and the remaining step refs."""
        if self.x_resident is None:
            return rest[0], rest[1:]
        pl.when(indices[0] == 0)(lambda: plgpu.barrier_wait(self.x_loaded))
        start = pl.multiple_of(indices[0] * self.geo.block_k, self.geo.block_k)
        return self.x_resident.at[:, pl.ds(start, self.geo.block_k)], rest

    def upcast(self, q_smem, z_smem, sub: int, c: int):
        """Chunk `c` of row tile `sub` in the compute dtype, its zero points subtracted; and its group in the step."""
        geo = self.geo
        g = c if geo.groups_per_step > 1 else 0
        w = q_smem.at[pl.ds(sub * TILE_N, TILE_N), pl.ds(c * geo.chunk, geo.chunk)][...].astype(geo.compute)
        if z_smem is not None:
            zero = self.row(z_smem, g, sub).astype(jnp.float32).astype(w.dtype)  # eighths: exact
            w = w - lax.broadcast_in_dim(zero, w.shape, [0])
        return w, g

    def x_chunk(self, x_smem, c: int):
        return x_smem.at[:, pl.ds(c * self.geo.chunk, self.geo.chunk)]

    def add_scaled_chunks(self, total, q_smem, x_smem, s_smem, z_smem, sub, staging=None):
        """`total` plus row tile `sub`'s product over the step, each chunk's into a fresh accumulator, awaited and
        scaled by its group. `staging`: the interpreter form's shared-memory tile (default: the program's)."""
        geo = self.geo
        for c in range(geo.block_k // geo.chunk):
            w, g = self.upcast(q_smem, z_smem, sub, c)
            part = pl.run_scoped(functools.partial(_product, w=w, x_tile=self.x_chunk(x_smem, c),
                                                   staged=staging or self.staged),
                                 plgpu.ACC((TILE_N, geo.rows), jnp.float32))
            scale = self.row(s_smem, g, sub).astype(jnp.float32)
            total = total + part * lax.broadcast_in_dim(scale, part.shape, [0])
        return total

    def add_scaled_step(self, totals: tuple, q_smem, x_smem, s_smem, z_smem) -> tuple:
        """`add_scaled_chunks` for every row tile of the program."""
        return tuple(self.add_scaled_chunks(total, q_smem, x_smem, s_smem, z_smem, sub)
                     for sub, total in enumerate(totals))


def _program(q_ref, x_ref, s_ref, *refs, geo: _Geometry, steps: int, zero_points: bool, max_concurrent_steps: int):
    z_ref, out_ref, out_smem, scratch = _split_refs(refs, zero_points)
    resident = scratch[:2] if geo.resident_span else (None, None)
    tiles = _Tiles(geo, lax.axis_index("split") * steps, zero_points, *resident,
                   tuple(scratch[2:] if geo.resident_span else scratch))
    if tiles.x_resident is not None:  # issued before the pipeline's first weight loads, awaited by its first step
        plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(tiles.first * geo.block_k, geo.resident_span)],
                                tiles.x_resident, tiles.x_loaded)
    concurrent = min(max_concurrent_steps, steps)
    # one_accumulator leaves a step's last product in flight into the next step: its activation slot is released a
    # step late (a single step, or resident activations, need no delay)
    delay = 1 if geo.one_accumulator and tiles.x_resident is None and concurrent > 1 else 0
    in_specs, operands, columns = _pipeline_inputs(geo, tiles, q_ref, x_ref, s_ref, z_ref, delay)
    pipeline = functools.partial(plgpu.emit_pipeline, grid=(steps,), in_specs=in_specs,
                                 max_concurrent_steps=concurrent)
    if geo.one_accumulator:
        totals = _one_accumulator(tiles, pipeline, operands, in_scales=geo.scaled_weights, wait_each_step=not delay)
    else:
        totals = _scaled_per_chunk(tiles, pipeline, operands)
    for sub, total in enumerate(totals):
        out_smem[pl.ds(sub * TILE_N, TILE_N)] = total
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[lax.axis_index("split"), columns])
    plgpu.wait_smem_to_gmem(0)


def _split_refs(refs, zero_points: bool):
    """A program's refs after the weight, activations and scales: zero points (or None), the output, its
    shared-memory tile and the scratch after it."""
    z_ref = refs[0] if zero_points else None
    out_ref, out_smem, *scratch = refs[1:] if zero_points else refs
    return z_ref, out_ref, out_smem, scratch


def _pipeline_inputs(geo: _Geometry, tiles: _Tiles, q_ref, x_ref, s_ref, z_ref, delay: int = 0):
    """A program's pipeline in-specs (weight, activations unless resident, scales unless applied after the kernel,
    zero points), the refs they read, and the program's output features. `delay`: steps the activations' slot is
    held past its own."""
    first = tiles.first
    scale_spec = not geo.one_accumulator or geo.scaled_weights
    in_specs = _step_specs(geo, q_ref.dtype, lambda i: (0, first + i), with_x=tiles.x_resident is None,
                           with_scales=scale_spec, zero_points=z_ref is not None, delay=delay)
    columns = pl.ds(pl.multiple_of(lax.axis_index("tile") * geo.tile_n, geo.tile_n), geo.tile_n)
    operands = ([q_ref.at[columns]] + ([x_ref] if tiles.x_resident is None else [])
                + ([s_ref.at[:, columns]] if scale_spec else [])
                + ([z_ref.at[:, columns]] if z_ref is not None else []))
    return in_specs, operands, columns


def _step_specs(geo: _Geometry, q_dtype, where, *, with_x: bool = True, with_scales: bool = True,
                zero_points: bool = False, delay: int = 0) -> list:
    """A step's in-specs (weight tile; activations; group scales; zero points), `where(i)` giving pipeline step
    `i`'s output tile block and input step. `delay`: steps the activations' slot is held past its own."""
    def at(index):
        return lambda i: index(*where(i))

    groups = pl.BlockSpec((geo.groups_per_step, geo.tile_n), at(lambda t, k: (geo.group_block(k), t)))
    specs = [plgpu.BlockSpec((geo.tile_n, geo.block_k), at(lambda t, k: (t, k)),
                             transforms=_swizzled(q_dtype, geo.block_k, geo.chunk))]
    if with_x:
        specs.append(plgpu.BlockSpec((geo.rows, geo.block_k), at(lambda t, k: (0, k)),
                                     transforms=_swizzled(geo.compute, geo.block_k, geo.chunk), delay_release=delay))
    return specs + ([groups] if with_scales else []) + ([groups] if zero_points else [])


def _warp_specialized_program(q_ref, x_ref, s_ref, *refs, geo: _Geometry, steps: int, zero_points: bool,
                              max_concurrent_steps: int):
    """The per-chunk form with a memory warpgroup issuing every step's loads and one compute warpgroup per 64
    output features, each upcasting and multiplying its own rows: twice the registers and issue slots for the
    upcast that a single warpgroup spends, while the loads never wait on it."""
    z_ref, out_ref, out_smem, staging = _split_refs(refs, zero_points)
    wg = lax.axis_index("wg")
    tiles = _Tiles(geo, lax.axis_index("split") * steps, zero_points)
    in_specs, operands, columns = _pipeline_inputs(geo, tiles, q_ref, x_ref, s_ref, z_ref)
    own = pl.ds(pl.multiple_of(wg * TILE_N, TILE_N), TILE_N)

    def step(indices, q_smem, x_smem, s_smem, *rest):
        z_smem, total = (rest[0], rest[1]) if zero_points else (None, rest[0])
        return tiles.add_scaled_chunks(total, q_smem, x_smem, s_smem, z_smem, wg,
                                       (staging[0].at[wg],) if staging else None)

    def compute(run):
        out_smem[own] = run(_zero_total(geo))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[own], out_ref.at[lax.axis_index("split"), columns].at[own])
        plgpu.wait_smem_to_gmem(0)

    plgpu.emit_pipeline_warp_specialized(
        step, grid=(steps,), memory_registers=40, in_specs=in_specs, wg_axis="wg",
        num_compute_wgs=geo.tile_n // TILE_N, max_concurrent_steps=min(max_concurrent_steps, steps),
        compute_context=compute)(*operands)


def _persistent_program(q_ref, x_ref, s_ref, *refs, geo: _Geometry, steps: int, split: int, items: int,
                        programs: int, zero_points: bool, max_concurrent_steps: int):
    """Work items `me, me + programs, ...` (item = tile · split + range; the last wave's overrun repeats the final
    item, writing what it wrote) as one pipeline of `steps` steps an item: the running sums reset after an item's
    last step, whose result goes out through one of two shared-memory slots while the next item's steps run."""
    z_ref, out_ref, out_smem, staged = _split_refs(refs, zero_points)
    me = lax.axis_index("program")
    tiles = _Tiles(geo, 0, zero_points, staged=tuple(staged))
    waves = -(-items // programs)

    def item(i):
        """Flat step `i`'s output tile, input range and input step."""
        which = jnp.minimum(me + i // steps * programs, items - 1)
        tile, part = which // split, which % split
        return tile, part, part * steps + i % steps

    def tile_and_step(i):
        tile, _, k = item(i)
        return tile, k

    in_specs = _step_specs(geo, q_ref.dtype, tile_and_step, zero_points=zero_points)

    def step(indices, q_smem, x_smem, s_smem, *rest):
        z_smem, totals = (rest[0], rest[1]) if zero_points else (None, rest[0])
        totals = tiles.add_scaled_step(totals, q_smem, x_smem, s_smem, z_smem)
        i = indices[0]
        last = i % steps == steps - 1

        @pl.when(last)
        def _send():
            slot = out_smem.at[i // steps % 2]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this slot's previous result has left
            for sub, total in enumerate(totals):
                slot[pl.ds(sub * TILE_N, TILE_N)] = total
            plgpu.commit_smem()
            tile, part, _ = item(i)
            columns = pl.ds(pl.multiple_of(tile * geo.tile_n, geo.tile_n), geo.tile_n)
            plgpu.copy_smem_to_gmem(slot, out_ref.at[part, columns])

        keep = jnp.where(last, 0.0, 1.0).astype(jnp.float32)
        return tuple(total * keep for total in totals)

    plgpu.emit_pipeline(step, grid=(waves * steps,), in_specs=in_specs, init_carry=_zero_totals(geo),
                        max_concurrent_steps=min(max_concurrent_steps, waves * steps))(
        q_ref, x_ref, s_ref, *([z_ref] if zero_points else []))
    plgpu.wait_smem_to_gmem(0)


def _scaled_per_chunk(tiles: _Tiles, pipeline, operands) -> tuple:
    """Each chunk's product into a fresh accumulator, awaited, scaled by its group and added to a running sum."""
    geo = tiles.geo

    def step(indices, q_smem, *rest):
        x_smem, rest = tiles.x_slice(indices, rest)
        s_smem, *rest = rest
        z_smem, totals = (rest[0], rest[1]) if tiles.zero_points else (None, rest[0])
        return tiles.add_scaled_step(totals, q_smem, x_smem, s_smem, z_smem)

    return pipeline(step, init_carry=_zero_totals(geo))(*operands)


def _zero_total(geo: _Geometry):
    return plgpu.layout_cast(jnp.zeros((TILE_N, geo.rows), jnp.float32), plgpu.Layout.WGMMA)


def _zero_totals(geo: _Geometry) -> tuple:
    """A running sum per row tile of the program."""
    return tuple(_zero_total(geo) for _ in range(geo.tile_n // TILE_N))


def _one_accumulator(tiles: _Tiles, pipeline, operands, *, in_scales: bool, wait_each_step: bool) -> tuple:
    """Every chunk's product into one accumulator per row tile, group scales multiplied into the weights first
    (`in_scales`), one product left in flight; `wait_each_step`: await the step's products before its slots go."""
    geo = tiles.geo

    def step(accs, indices, q_smem, *rest):
        x_smem, rest = tiles.x_slice(indices, rest)
        s_smem, rest = (rest[0], rest[1:]) if in_scales else (None, rest)
        z_smem = rest[0] if tiles.zero_points else None
        for sub, acc in enumerate(accs):
            for c in range(geo.block_k // geo.chunk):
                w, g = tiles.upcast(q_smem, z_smem, sub, c)
                if s_smem is not None:
                    scale = tiles.row(s_smem, g, sub).astype(jnp.float32).astype(w.dtype)
                    w = w * lax.broadcast_in_dim(scale, w.shape, [0])
                _issue_product(acc, w, tiles.x_chunk(x_smem, c), tiles.staged)
        if wait_each_step and tiles.x_resident is None:
            plgpu.wgmma_wait(0)

    def accumulate(*accs):
        pipeline(functools.partial(step, accs))(*operands)
        plgpu.wgmma_wait(0)
        return tuple(acc[...] for acc in accs)

    return pl.run_scoped(accumulate, *[plgpu.ACC((TILE_N, geo.rows), jnp.float32)
                                       for _ in range(geo.tile_n // TILE_N)])


def _issue_product(acc_ref, w, x_tile, staged) -> None:
    """`acc_ref += w @ x_tileᵀ`, left in flight (at most one product outstanding after it)."""
    if staged:  # the interpreter's form: the staging tile is rewritten, so the previous product must be done
        plgpu.wgmma_wait(0)
        staged[0][...] = w
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, staged[0], x_tile.T)
    else:
        plgpu.wgmma(acc_ref, w, x_tile.T)
    plgpu.wgmma_wait(1)


def _product(acc_ref, *, w, x_tile, staged):
    """One chunk's `w @ x_tileᵀ` into the fresh accumulator `acc_ref`, returned as a value."""
    if staged:
        staged[0][...] = w
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, staged[0], x_tile.T)
    else:
        plgpu.wgmma(acc_ref, w, x_tile.T)
    return acc_ref[...]
