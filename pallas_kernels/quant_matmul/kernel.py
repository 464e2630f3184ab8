"""x `[m, k]` times an 8-bit weight stored `[n, k]` (input-minor, as cuBLASLt's FP8 GEMM takes it), times one
float32 scale per output column, for the few rows of a decode step.

Decode is bandwidth-bound: the weight's bytes are what the step must move, so each program reads one `block_n × k`
strip of the 8-bit weight once (tiles of `block_n × block_k`, pipelined over K), upcasts each tile to the
activations' dtype in registers and accumulates in float32 on the tensor cores; the column scales apply to the
accumulator at the end. No dequantized copy of the weight exists anywhere. Narrow column strips spread the weight
over every SM (a 4,096-column projection is 256 programs of 16 columns); `k_splits` > 1 also splits K across
programs, each writing float32 partial sums that XLA adds (wide strips with a short K loop each, for the tile shapes a
sweep may prefer: `scripts/quant8_sweep.py`).

Triton rules (JAX-PALLAS.md §1.2): power-of-two tiles, ragged edges masked, no scratch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr
from jaxtyping import Array, Float

MAX_ROWS = 16  # one row tile: the decode buckets this kernel serves


def _arange(start, size: int):
    return start + jnp.arange(size, dtype=jnp.int32)


def _kernel(x_ref, w_ref, s_ref, y_ref, *, block_m: int, block_n: int, block_k: int, steps_per_split: int,
            split: bool):
    m_dim, k_dim = x_ref.shape
    n_dim = w_ref.shape[0]
    rows, cols = _arange(0, block_m), _arange(pl.program_id(0) * block_n, block_n)
    first = pl.program_id(1) * steps_per_split

    def step(i, acc):
        ks = _arange((first + i) * block_k, block_k)
        x = pltr.load(x_ref.at[rows[:, None], ks[None, :]], mask=(rows[:, None] < m_dim) & (ks[None, :] < k_dim),
                      other=0)
        # no `other`: the lowering cannot cast a fill value to float8; masked-off K columns of x are 0 and the
        # weight's are zeroed after the upcast, columns past n are never stored
        in_k = ks[None, :] < k_dim
        w = pltr.load(w_ref.at[cols[:, None], ks[None, :]], mask=(cols[:, None] < n_dim) & in_k)
        w = jnp.where(in_k, w.astype(x.dtype), 0)
        return acc + jnp.dot(x, w.T, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps_per_split, step, jnp.zeros((block_m, block_n), jnp.float32))
    out_mask = (rows[:, None] < m_dim) & (cols[None, :] < n_dim)
    if split:  # float32 partial sums of this K split; the caller adds them and applies the scales
        pltr.store(y_ref.at[pl.program_id(1), rows[:, None], cols[None, :]], acc, mask=out_mask)
        return
    scale = pltr.load(s_ref.at[cols], mask=cols < n_dim, other=0.0)
    pltr.store(y_ref.at[rows[:, None], cols[None, :]], (acc * scale[None, :]).astype(y_ref.dtype), mask=out_mask)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_warps", "num_stages", "k_splits", "interpret"))
def few_token_matmul(
    x: Float[Array, "m k"], w: Array, scale: Float[Array, " n"], *, block_n: int = 16, block_k: int = 256,
    num_warps: int = 4, num_stages: int = 4, k_splits: int = 1, interpret: bool = False,
) -> Float[Array, "m n"]:
    """`(x @ w.T) * scale` in x's dtype, for `m <= MAX_ROWS` rows; w `[n, k]` float8_e4m3fn or int8. `k_splits`
    is rounded down so that every split has at least one `block_k` step."""
    m, n, k = x.shape[0], w.shape[0], x.shape[1]
    if m > MAX_ROWS:
        raise ValueError(f"few_token_matmul takes at most {MAX_ROWS} rows, got {m}")
    steps = pl.cdiv(k, block_k)
    splits = max(1, min(k_splits, steps))
    per_split = pl.cdiv(steps, splits)
    splits = pl.cdiv(steps, per_split)  # no empty split
    kernel = functools.partial(_kernel, block_m=MAX_ROWS, block_n=block_n, block_k=block_k,
                               steps_per_split=per_split, split=splits > 1)
    shape = (splits, m, n) if splits > 1 else (m, n)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, block_n), splits),
        in_specs=[pl.no_block_spec] * 3,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(shape, jnp.float32 if splits > 1 else x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="few_token_quant_matmul",
    )(x, w, scale.astype(jnp.float32))
    if splits == 1:
        return out
    return (out.sum(axis=0) * scale.astype(jnp.float32)[None, :]).astype(x.dtype)
