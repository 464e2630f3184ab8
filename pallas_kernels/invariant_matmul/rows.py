"""Row reductions whose result for a row does not depend on how many rows run beside it: RMSNorm and log-sum-exp.

XLA's GPU reduction emitter picks its thread layout by the whole shape, so the same row summed inside 16 rows and
inside 64 can round differently (seen on the H200 for a log-softmax over a 128k vocabulary). Here one program
reduces one row, walking it in chunks of `CHUNK` columns from 0 upwards into a `CHUNK`-wide float32 accumulator
that is summed once at the end: the order is the same for every row count.

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


def _columns(i, width: int):
    cols = i * CHUNK + jnp.arange(CHUNK, dtype=jnp.int32)
    return cols, cols < width


def _rms_kernel(x_ref, w_ref, o_ref, *, eps: float):
    width = x_ref.shape[1]
    row = pl.program_id(0)
    chunks = pl.cdiv(width, CHUNK)

    def squares(i, acc):
        cols, valid = _columns(i, width)
        x = pltr.load(x_ref.at[row, cols], mask=valid, other=0).astype(jnp.float32)
        return acc + x * x

    total = jnp.sum(lax.fori_loop(0, chunks, squares, jnp.zeros((CHUNK,), jnp.float32)))
    scale = lax.rsqrt(total / width + eps)

    def write(i, carry):
        cols, valid = _columns(i, width)
        x = pltr.load(x_ref.at[row, cols], mask=valid, other=0).astype(jnp.float32)
        w = pltr.load(w_ref.at[cols], mask=valid, other=0).astype(jnp.float32)
        normed = (x * scale).astype(x_ref.dtype).astype(jnp.float32)  # HF: the weight applies after the cast back
        pltr.store(o_ref.at[row, cols], (w * normed).astype(o_ref.dtype), mask=valid)
        return carry

    lax.fori_loop(0, chunks, write, 0)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm_rows(x: Float[Array, "... d"], weight: Float[Array, " d"], *, eps: float,
                  interpret: bool = False) -> Float[Array, "... d"]:
    """HF's RMSNorm (statistics in float32, the weight applied after casting back), one row per program."""
    flat = x.reshape(-1, x.shape[-1])
    out = pl.pallas_call(
        functools.partial(_rms_kernel, eps=eps),
        grid=(flat.shape[0],),
        in_specs=[pl.no_block_spec] * 2,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(flat.shape, jnp.result_type(weight.dtype, x.dtype)),
        compiler_params=pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="invariant_rms_norm",
    )(flat, weight)
    return out.reshape(x.shape)


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
    return pl.pallas_call(
        _lse_kernel,
        grid=(x.shape[0],),
        in_specs=[pl.no_block_spec],
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((x.shape[0],), jnp.float32),
        compiler_params=pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="invariant_logsumexp",
    )(x)


def log_softmax_rows(x: Float[Array, "n v"], *, interpret: bool = False) -> Float[Array, "n v"]:
    """x - logsumexp(x) per row (float32): the subtraction is elementwise, so the whole is row-invariant."""
    return x.astype(jnp.float32) - logsumexp_rows(x, interpret=interpret)[:, None]


