"""`x @ w` (or `x @ wᵀ`) with a row's result independent of the other rows: batch invariance.

cuBLAS and XLA pick a GEMM algorithm (tile shape, split-K, stream-K) by the problem's shape, so a token's logits
change with the number of rows beside it. Here one tile configuration serves every row count: programs of
`TILE.block_m × TILE.block_n` outputs walk K in steps of `TILE.block_k`, each step one tensor-core dot accumulated
into float32; rows past `m` are masked, never computed into the real rows. Ragged K and N edges are zero-masked.

K is cut into a fixed number of chunks (`k_chunks`), chosen from the weight's shape alone: each chunk is summed
from zero, and the chunk sums are added in chunk order. A decode step's few rows would leave most SMs idle on a
narrow weight (the 8B model's o and down projections: 32 column tiles for 132 SMs), so there the chunks run as
programs of their own, writing float32 partials that are then added in chunk order; a larger step sums its chunks
one after the other inside each program. The arithmetic is the same either way, instruction for instruction and in
the same order, so a row's result never depends on which way its step ran. Inside one program the chunks share one
loop over K (a chunk folded into the total at its last step), so the software pipeline is not restarted per chunk.

The output tile may vary by shape (`tile_for`: 128 × 256 for one-chunk weights at prefill row counts) since it only
decides which program computes an output, not that output's additions.

Triton rules (JAX-PALLAS.md §1.2): power-of-two tiles, ragged edges masked, no scratch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr
from jaxtyping import Array, Float


@dataclasses.dataclass(frozen=True)
class Tile:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


TILE = Tile()  # the K steps of every shape (the point of the kernel), and the output tile of most
# The output tile of wide projections (the fused gate/up, the LM head) at prefill row counts: it changes which
# program computes an output, not the K steps or chunks, so a row's bits stay the same (checked on an H100 by
# `scripts/probe_invariance_gpu.py --tile-candidates`: every candidate kept every bit, this one ran the 8B gate/up
# at 4,096 rows in 1.52 ms against TILE's 2.46 and the LM head in 6.5 against 10.7; the narrower projections were
# slower with it). Decode steps keep TILE: their single row tile splits K instead.
WIDE = Tile(block_m=128, block_n=256, num_warps=8, num_stages=3)
WIDE_MIN_ROWS, WIDE_MIN_COLUMNS = 128, 16384


def tile_for(m: int, k: int, n: int) -> Tile:
    """The output tile of an `[m, k] @ [k, n]` product (same K steps for all: `TILE`'s); the wide one only where K
    is one chunk (`_kernel_whole` keeps a second accumulator otherwise, which the wide tile spills)."""
    wide = m >= WIDE_MIN_ROWS and n >= WIDE_MIN_COLUMNS and k_chunks(k, n) == 1
    return WIDE if wide else TILE


TARGET_PROGRAMS = 132  # one wave of an H100/H200's SMs for a decode step's single row tile
MAX_CHUNKS = 16
MIN_CHUNK_STEPS = 4  # a chunk of fewer K steps would spend more on its partial than its loads
SPLIT_MAX_ROWS = 64  # steps of at most this many rows may run their chunks as programs (one row tile)


def k_chunks(k: int, n: int, tile: Tile = TILE) -> int:
    """The number of K chunks of a `[k, n]` weight (a power of two): enough that a row tile's column tiles times
    the chunks fill `TARGET_PROGRAMS`, each chunk at least MIN_CHUNK_STEPS steps. A function of the weight's shape
    only, so every row count reduces the same way."""
    column_tiles = pl.cdiv(n, tile.block_n)
    most = min(MAX_CHUNKS, max(1, k // (MIN_CHUNK_STEPS * tile.block_k)))
    chunks = 1
    while column_tiles * chunks < TARGET_PROGRAMS and 2 * chunks <= most:
        chunks *= 2
    return chunks


def split_pays(m: int, k: int, chunks: int, weight_itemsize: int) -> bool:
    """Whether `m` rows run their K chunks as programs: a single row tile (more rows already fill the SMs) whose
    float32 partials, written and read back (8·m·n·chunks bytes), cost at most half the weight's bytes. Only speed
    follows: both ways give the same bits."""
    return chunks > 1 and m <= SPLIT_MAX_ROWS and 16 * m * chunks <= k * weight_itemsize


def _arange(start, size: int):
    return start + jnp.arange(size, dtype=jnp.int32)


def _step_product(x_ref, w_ref, rows, cols, i, *, tile: Tile, transposed: bool):
    """K step `i`'s float32 product of this program's tile."""
    m_dim, k_dim = x_ref.shape
    n_dim = w_ref.shape[0] if transposed else w_ref.shape[1]
    ks = _arange(i * tile.block_k, tile.block_k)
    x = pltr.load(x_ref.at[rows[:, None], ks[None, :]], mask=(rows[:, None] < m_dim) & (ks[None, :] < k_dim),
                  other=0)
    if transposed:  # w [n, k]
        w = pltr.load(w_ref.at[cols[:, None], ks[None, :]],
                      mask=(cols[:, None] < n_dim) & (ks[None, :] < k_dim), other=0).T
    else:
        w = pltr.load(w_ref.at[ks[:, None], cols[None, :]],
                      mask=(ks[:, None] < k_dim) & (cols[None, :] < n_dim), other=0)
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def _chunk_sum(x_ref, w_ref, rows, cols, first_step, end_step, *, tile: Tile, transposed: bool):
    """The float32 sum over K steps [first_step, end_step) of this program's tile, from zero."""
    def step(i, acc):
        return acc + _step_product(x_ref, w_ref, rows, cols, i, tile=tile, transposed=transposed)

    return lax.fori_loop(first_step, end_step, step, jnp.zeros((tile.block_m, tile.block_n), jnp.float32))


def _tile_indices(tile: Tile):
    return (_arange(pl.program_id(0) * tile.block_m, tile.block_m),
            _arange(pl.program_id(1) * tile.block_n, tile.block_n))


def _kernel_whole(x_ref, w_ref, y_ref, *, tile: Tile, transposed: bool, chunk_steps: int):
    """Every chunk of the tile in one loop over K (one software pipeline, not one per chunk): each chunk summed
    from zero, and at its last step added to the chunks before it, in chunk order (the first one taken as is). A
    single chunk keeps one accumulator: two would spill the wide tile's registers (on an H100 the 8B gate/up at
    4,096 rows took 3.06 ms with two, 1.52 with one)."""
    rows, cols = _tile_indices(tile)
    steps = pl.cdiv(x_ref.shape[1], tile.block_k)
    if chunk_steps >= steps:
        total = _chunk_sum(x_ref, w_ref, rows, cols, 0, steps, tile=tile, transposed=transposed)
        _store_tile(y_ref, rows, cols, total)
        return
    zeros = jnp.zeros((tile.block_m, tile.block_n), jnp.float32)

    def step(i, carry):
        total, chunk = carry
        chunk = chunk + _step_product(x_ref, w_ref, rows, cols, i, tile=tile, transposed=transposed)
        ends = (lax.rem(i + 1, chunk_steps) == 0) | (i + 1 == steps)  # i ≥ 0: no sign fix-up of `%`
        total = jnp.where(ends, jnp.where(i < chunk_steps, chunk, total + chunk), total)
        return total, jnp.where(ends, zeros, chunk)

    total, _ = lax.fori_loop(0, steps, step, (zeros, zeros))
    _store_tile(y_ref, rows, cols, total)


def _store_tile(y_ref, rows, cols, total):
    pltr.store(y_ref.at[rows[:, None], cols[None, :]], total.astype(y_ref.dtype),
               mask=(rows[:, None] < y_ref.shape[0]) & (cols[None, :] < y_ref.shape[1]))


def _kernel_chunk(x_ref, w_ref, partial_ref, *, tile: Tile, transposed: bool, chunk_steps: int):
    """One chunk of the tile (grid axis 2), its float32 sum stored as that chunk's partial."""
    rows, cols = _tile_indices(tile)
    chunk = pl.program_id(2)
    steps = pl.cdiv(x_ref.shape[1], tile.block_k)
    part = _chunk_sum(x_ref, w_ref, rows, cols, jnp.minimum(chunk * chunk_steps, steps),
                      jnp.minimum((chunk + 1) * chunk_steps, steps), tile=tile, transposed=transposed)
    m_dim, n_dim = partial_ref.shape[1:]
    pltr.store(partial_ref.at[chunk, rows[:, None], cols[None, :]], part,
               mask=(rows[:, None] < m_dim) & (cols[None, :] < n_dim))


@functools.partial(jax.jit, static_argnames=("transposed", "out_dtype", "interpret", "split", "tile", "chunks"))
def invariant_matmul(
    x: Float[Array, "m k"], w: Float[Array, "k n"] | Float[Array, "n k"], *, transposed: bool = False,
    out_dtype=None, interpret: bool = False, split: bool | None = None, tile: Tile | None = None,
    chunks: int | None = None,
) -> Float[Array, "m n"]:
    """`x @ w` (`transposed`: `x @ w.T` for w `[n, k]`, the LM head's layout), in `out_dtype` (x's by default).
    `split`: run the K chunks as programs of their own (default: for steps of at most SPLIT_MAX_ROWS rows); the
    result is the same either way. `tile`: the output tile (and warps, stages) for the K steps and chunks `TILE`
    fixes; default `tile_for` the shape. `chunks`: the K chunks (default `k_chunks` of the weight's shape; another
    count gives other bits, for probes of other schemes)."""
    (m, k), n = x.shape, w.shape[0] if transposed else w.shape[1]
    tile = tile or tile_for(m, k, n)
    out_dtype = out_dtype or x.dtype
    chunks = chunks or k_chunks(k, n)
    if tile.block_k != TILE.block_k and chunks > 1:
        raise ValueError(f"tile.block_k={tile.block_k}: K chunks are counted in steps of {TILE.block_k}")
    chunk_steps = pl.cdiv(pl.cdiv(k, TILE.block_k), chunks)
    if split is None:
        split = split_pays(m, k, chunks, jnp.dtype(w.dtype).itemsize)
    grid = (pl.cdiv(m, tile.block_m), pl.cdiv(n, tile.block_n))
    params = dict(in_specs=[pl.no_block_spec] * 2, out_specs=pl.no_block_spec, interpret=interpret,
                  compiler_params=pltr.CompilerParams(num_warps=tile.num_warps, num_stages=tile.num_stages))
    if not split:
        kernel = functools.partial(_kernel_whole, tile=tile, transposed=transposed, chunk_steps=chunk_steps)
        return pl.pallas_call(kernel, grid=grid, out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
                              name="invariant_matmul", **params)(x, w)
    kernel = functools.partial(_kernel_chunk, tile=tile, transposed=transposed, chunk_steps=chunk_steps)
    partials = pl.pallas_call(kernel, grid=(*grid, chunks), out_shape=jax.ShapeDtypeStruct((chunks, m, n), jnp.float32),
                              name="invariant_matmul_chunks", **params)(x, w)
    total = partials[0]
    for chunk in range(1, chunks):  # chunk order, as the whole-tile kernel adds them (XLA keeps this order)
        total = total + partials[chunk]
    return total.astype(out_dtype)
