"""Row reductions whose result for a row does not depend on how many rows run beside it: RMSNorm and log-sum-exp.

XLA's GPU reduction emitter picks its thread layout by the whole shape, so the same row summed inside 16 rows and
inside 64 can round differently (seen on the H200 for a log-softmax over a 128k vocabulary). Here one program
reduces one row, walking it in chunks of `CHUNK` columns from 0 upwards into a `CHUNK`-wide float32 accumulator
that is summed once at the end: the order is the same for every row count. The RMSNorm can take the residual add
before it as well (`add_rms_norm_rows`): one launch instead of an XLA add and the norm.

Triton rules (JAX-PALLAS.md §1.2): power-of-two blocks, ragged edges masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr
from jaxtyping import Array, Float

CHUNK = 1024  # columns per load; one configuration for every shape
NUM_WARPS = 4
MAX_UNROLLED_CHUNKS = 8  # rows up to 8,192 wide stay in registers (64 float32 a thread at 4 warps)


def _columns(i, width: int):
    cols = i * CHUNK + jnp.arange(CHUNK, dtype=jnp.int32)
    return cols, cols < width


def _rms_kernel(*refs, eps: float, add: bool, max_unrolled_chunks: int):
    """HF's RMSNorm of one row. `add` (refs x, delta, weight → sum, normed): of the row `x + delta`, added in
    float32 and rounded once to the sum's dtype as XLA rounds the add, and that sum written out too (the residual
    stream); the normed row is then bitwise the unfused path's (`x + delta`, then the plain kernel)."""
    x_ref, d_ref, w_ref, s_ref, o_ref = refs if add else (refs[0], None, refs[1], None, refs[2])
    _norm_row(x_ref, d_ref, w_ref, s_ref, o_ref, pl.program_id(0), eps, max_unrolled_chunks)


def _pair_kernel(a_ref, b_ref, wa_ref, wb_ref, oa_ref, ob_ref, *, eps: float, max_unrolled_chunks: int):
    """Two RMSNorms in one launch (a's rows, then b's, one program each), each row as `_rms_kernel` does it."""
    row, rows_a = pl.program_id(0), a_ref.shape[0]

    @pl.when(row < rows_a)
    def _():
        _norm_row(a_ref, None, wa_ref, None, oa_ref, row, eps, max_unrolled_chunks)

    @pl.when(row >= rows_a)
    def _():
        _norm_row(b_ref, None, wb_ref, None, ob_ref, row - rows_a, eps, max_unrolled_chunks)


def _norm_row(x_ref, d_ref, w_ref, s_ref, o_ref, row, eps: float, max_unrolled_chunks: int):
    """Row `row` of `x` (plus `d` where given, its sum stored to `s`) normed into `o`. A row of at most
    `max_unrolled_chunks` chunks is walked in straight-line code: its loads are then all in flight at once and the
    row stays in registers for the second pass, where a loop waits for each chunk twice. Both walks add the same
    chunks in the same order, so the bits do not depend on which one ran."""
    add = d_ref is not None
    source_dtype = s_ref.dtype if add else x_ref.dtype  # the dtype of the row that is normed
    width = x_ref.shape[1]
    chunks = pl.cdiv(width, CHUNK)

    def load(cols, valid):  # the normed row's chunk, exactly as stored in its own dtype, widened to float32
        x = pltr.load(x_ref.at[row, cols], mask=valid, other=0)
        if add:
            d = pltr.load(d_ref.at[row, cols], mask=valid, other=0)
            x = (x.astype(jnp.float32) + d.astype(jnp.float32)).astype(source_dtype)
        return x.astype(jnp.float32)

    def write(cols, valid, x, scale):
        w = pltr.load(w_ref.at[cols], mask=valid, other=0).astype(jnp.float32)
        normed = (x * scale).astype(source_dtype).astype(jnp.float32)  # HF: the weight applies after the cast back
        pltr.store(o_ref.at[row, cols], (w * normed).astype(o_ref.dtype), mask=valid)
        if add:
            pltr.store(s_ref.at[row, cols], x.astype(s_ref.dtype), mask=valid)

    def scale_of(squares):
        return lax.rsqrt(jnp.sum(squares) / width + eps)

    if chunks <= max_unrolled_chunks:
        spans = [_columns(i, width) for i in range(chunks)]
        row_chunks = [load(cols, valid) for cols, valid in spans]
        squares = jnp.zeros((CHUNK,), jnp.float32)
        for x in row_chunks:
            squares = squares + x * x
        scale = scale_of(squares)
        for (cols, valid), x in zip(spans, row_chunks):
            write(cols, valid, x, scale)
        return

    def add_squares(i, acc):
        x = load(*_columns(i, width))
        return acc + x * x

    scale = scale_of(lax.fori_loop(0, chunks, add_squares, jnp.zeros((CHUNK,), jnp.float32)))

    def write_chunk(i, carry):
        cols, valid = _columns(i, width)
        write(cols, valid, load(cols, valid), scale)  # the sum recomputed, not read back: another thread wrote it
        return carry

    lax.fori_loop(0, chunks, write_chunk, 0)


def _row_programs(kernel, num_rows: int, args: tuple[Array, ...], out_shapes: list[jax.ShapeDtypeStruct], *,
                  name: str, interpret: bool) -> list[Array]:
    """`kernel` on `num_rows` programs, one a row (every ref whole; the kernel finds its row by `program_id`)."""
    return pl.pallas_call(
        kernel,
        grid=(num_rows,),
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=[pl.no_block_spec] * len(out_shapes),
        out_shape=out_shapes,
        compiler_params=pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name=name,
    )(*args)


def _norm_rows(name: str, inputs: tuple[Array, ...], weight: Array, out_dtypes: tuple, *, eps: float,
               interpret: bool, max_unrolled_chunks: int) -> list[Array]:
    """The RMSNorm kernel over `inputs`' rows (x, or x and delta, flattened to [n, d]), one program per row."""
    flat = [a.reshape(-1, a.shape[-1]) for a in inputs]
    kernel = functools.partial(_rms_kernel, eps=eps, add=len(inputs) == 2,
                               max_unrolled_chunks=max_unrolled_chunks)
    return _row_programs(kernel, flat[0].shape[0],
                         (*flat, weight), [jax.ShapeDtypeStruct(flat[0].shape, dtype) for dtype in out_dtypes],
                         name=name, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "max_unrolled_chunks"))
def rms_norm_rows(x: Float[Array, "... d"], weight: Float[Array, " d"], *, eps: float, interpret: bool = False,
                  max_unrolled_chunks: int = MAX_UNROLLED_CHUNKS) -> Float[Array, "... d"]:
    """HF's RMSNorm (statistics in float32, the weight applied after casting back), one row per program.
    `max_unrolled_chunks`: the widest row (in CHUNKs) walked in straight-line code (0: every row in a loop)."""
    (out,) = _norm_rows("invariant_rms_norm", (x,), weight, (jnp.result_type(weight.dtype, x.dtype),), eps=eps,
                        interpret=interpret, max_unrolled_chunks=max_unrolled_chunks)
    return out.reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "max_unrolled_chunks"))
def add_rms_norm_rows(x: Float[Array, "... d"], delta: Float[Array, "... d"], weight: Float[Array, " d"], *,
                      eps: float, interpret: bool = False, max_unrolled_chunks: int = MAX_UNROLLED_CHUNKS
                      ) -> tuple[Float[Array, "... d"], Float[Array, "... d"]]:
    """(x + delta, `rms_norm_rows` of it) in one launch: a residual add fused into the norm after it, each output
    bitwise the unfused path's (vLLM's fused_add_rms_norm)."""
    total = jnp.result_type(x.dtype, delta.dtype)
    out = _norm_rows("invariant_add_rms_norm", (x, delta), weight, (total, jnp.result_type(weight.dtype, total)),
                     eps=eps, interpret=interpret, max_unrolled_chunks=max_unrolled_chunks)
    return out[0].reshape(x.shape), out[1].reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "max_unrolled_chunks"))
def rms_norm_pair_rows(a: Float[Array, "... d"], b: Float[Array, "... d"], weight_a: Float[Array, " d"],
                       weight_b: Float[Array, " d"], *, eps: float, interpret: bool = False,
                       max_unrolled_chunks: int = MAX_UNROLLED_CHUNKS
                       ) -> tuple[Float[Array, "... d"], Float[Array, "... d"]]:
    """(`rms_norm_rows(a, weight_a)`, `rms_norm_rows(b, weight_b)`) in one launch, each bitwise the separate call
    (Qwen3's query and key norms: one launch a layer instead of two)."""
    flat_a, flat_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    if flat_a.shape[1] != flat_b.shape[1]:
        raise ValueError(f"rows of {flat_a.shape[1]} and {flat_b.shape[1]}: a pair of norms shares its row width")
    dtypes = (jnp.result_type(weight_a.dtype, a.dtype), jnp.result_type(weight_b.dtype, b.dtype))
    out_a, out_b = _row_programs(
        functools.partial(_pair_kernel, eps=eps, max_unrolled_chunks=max_unrolled_chunks),
        flat_a.shape[0] + flat_b.shape[0],
        (flat_a, flat_b, weight_a, weight_b),
        [jax.ShapeDtypeStruct(f.shape, dtype) for f, dtype in zip((flat_a, flat_b), dtypes)],
        name="invariant_rms_norm_pair", interpret=interpret)
    return out_a.reshape(a.shape), out_b.reshape(b.shape)


def _lse_kernel(x_ref, o_ref):
    width = x_ref.shape[1]
    row = pl.program_id(0)

    def online(i, carry):  # per column slot: running max and sum of exp(x - max)
        top, total = carry
        cols, valid = _columns(i, width)
        x = pltr.load(x_ref.at[row, cols], mask=valid, other=-jnp.inf).astype(jnp.float32)
        new_top = jnp.maximum(top, x)
        finite = new_top > -jnp.inf  # a slot that has seen only -inf keeps a zero sum (no inf - inf)
        rescale = jnp.where(finite, jnp.exp(top - new_top), 0.0)
        total = total * rescale + jnp.where(finite, jnp.exp(x - new_top), 0.0)
        return new_top, total

    init = (jnp.full((CHUNK,), -jnp.inf, jnp.float32), jnp.zeros((CHUNK,), jnp.float32))
    top, total = lax.fori_loop(0, pl.cdiv(width, CHUNK), online, init)
    best = jnp.max(top)
    scaled = jnp.sum(jnp.where(top > -jnp.inf, total * jnp.exp(top - best), 0.0))
    o_ref[row] = best + jnp.log(scaled)


@functools.partial(jax.jit, static_argnames=("interpret",))
def logsumexp_rows(x: Float[Array, "n v"], *, interpret: bool = False) -> Float[Array, " n"]:
    """log(sum(exp(x))) of each row in float32 (-inf for a row of -inf), one row per program."""
    (out,) = _row_programs(_lse_kernel, x.shape[0], (x,), [jax.ShapeDtypeStruct((x.shape[0],), jnp.float32)],
                           name="invariant_logsumexp", interpret=interpret)
    return out


def log_softmax_rows(x: Float[Array, "n v"], *, interpret: bool = False) -> Float[Array, "n v"]:
    """x - logsumexp(x) per row (float32): the subtraction is elementwise, so the whole is row-invariant."""
    return x.astype(jnp.float32) - logsumexp_rows(x, interpret=interpret)[:, None]


