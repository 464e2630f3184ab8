"""The few-row (decode) W4A16 kernel: float32 multiply-adds on the CUDA cores, no tensor cores.

Program (column strip c, K split s) walks its input rows 128 a step (16 word rows): it loads the step's
`16 × block_n` words (each row of words one coalesced load), turns each nibble plane j into `f = 1 + q / 16`
(`nibbles.py`) and accumulates `x'_j · f_j` with `x'_j = 16 · x[8r + j]` (a strided load of x, broadcast over the
columns). Per word row r the zero point is folded in as one more multiply-add, `(Σ_j x'_j[r]) · (1 + z / 16)`, so
that `part[r, c] = Σ_j x_{8r+j} · (q − z)` exactly as the dequantized matmul; the group scale multiplies `part`
once per word. A group of 128 rows has one zero point and scale per step; groups of 32 or 64 rows one per word row
(gathered from the step's 4 or 2 groups). The accumulator keeps the 16 word rows apart; they are summed once,
after the loop. With K split, each split writes float32 partial sums and the caller adds them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.w4a16.nibbles import PACK, nibble_as_float


STEP_ROWS = 128  # input rows a loop step walks: 16 word rows
STEP_WORDS = STEP_ROWS // PACK


def _step_part(x_ref, row: int, words, step, zero):
    """`Σ_j x_{8r+j} (q_{8r+j} − z_r)` for the step's 16 word rows, `[16, block_n]` float32 (`zero` `[1 or 16,
    block_n]`: one group for the step, or one per word row)."""
    part, x_rows = None, None
    for j in range(PACK):
        strided = pl.ds(step * STEP_ROWS + j, STEP_WORDS, stride=PACK)  # input rows 8r + j of the step
        xj = x_ref[jnp.int32(row), strided].astype(jnp.float32) * 16
        term = xj[:, None] * nibble_as_float(words, j)
        part = term if part is None else part + term
        x_rows = xj if x_rows is None else x_rows + xj
    return part - x_rows[:, None] * (1 + zero / 16)


def _group_rows(z_ref, s_ref, step, cols, group: int):
    """The step's zero points and scales, `[1, block_n]` (a group of 128 rows or more) or `[16, block_n]` (one per
    word row, groups of 16 to 64 rows)."""
    if group >= STEP_ROWS:
        g = step // (group // STEP_ROWS)
        return z_ref[g, cols].astype(jnp.float32)[None, :], s_ref[g, cols].astype(jnp.float32)[None, :]
    rows = step * (STEP_ROWS // group) + jnp.arange(STEP_WORDS, dtype=jnp.int32) // (group // PACK)
    index = (rows[:, None], cols.start + jnp.arange(cols.size, dtype=jnp.int32)[None, :])
    return (pltr.load(z_ref.at[index]).astype(jnp.float32), pltr.load(s_ref.at[index]).astype(jnp.float32))


def gemv_kernel(x_ref, w_ref, z_ref, s_ref, y_ref, *, rows: int, block_n: int, group: int, steps_per_split: int,
                prefetch: bool):
    cols = pl.ds(pl.multiple_of(pl.program_id(0) * block_n, block_n), block_n)
    first = pl.program_id(1) * steps_per_split

    def load_words(g):
        return w_ref[pl.ds(pl.multiple_of(g * STEP_WORDS, STEP_WORDS), STEP_WORDS), cols]

    def accumulate(accs, g, words):
        zero, scale = _group_rows(z_ref, s_ref, g, cols, group)
        return tuple(acc + scale * _step_part(x_ref, r, words, g, zero) for r, acc in enumerate(accs))

    def step(i, accs):
        return accumulate(accs, first + i, load_words(first + i))

    def step_prefetching(i, carry):  # the next step's load is in flight while this one is used
        accs, words = carry
        upcoming = load_words(jnp.minimum(first + i + 1, first + steps_per_split - 1))
        return accumulate(accs, first + i, words), upcoming

    zeros = tuple(jnp.zeros((STEP_WORDS, block_n), jnp.float32) for _ in range(rows))
    if prefetch:
        accs, _ = lax.fori_loop(0, steps_per_split, step_prefetching, (zeros, load_words(first)))
    else:
        accs = lax.fori_loop(0, steps_per_split, step, zeros)
    for r, acc in enumerate(accs):
        y_ref[pl.program_id(1), r, cols] = jnp.sum(acc, axis=0).astype(y_ref.dtype)


def gemv_call(x, packed, zeros, scales, *, group: int, block_n: int, split: int, num_warps: int, num_stages: int,
              prefetch: bool, interpret: bool):
    """`[split, m, n]` partial sums (float32 when split, else x's dtype); `group` divides 128 or is a multiple of
    it."""
    m, k = x.shape
    n = packed.shape[1]
    out_dtype = jnp.float32 if split > 1 else x.dtype
    kernel = functools.partial(gemv_kernel, rows=m, block_n=block_n, group=group,
                               steps_per_split=k // STEP_ROWS // split, prefetch=prefetch)
    return pl.pallas_call(
        kernel,
        grid=(n // block_n, split),
        in_specs=[pl.no_block_spec] * 4,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((split, m, n), out_dtype),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="w4a16_gemv",
    )(x, packed, zeros, scales)
