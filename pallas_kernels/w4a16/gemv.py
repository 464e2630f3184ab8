"""The few-row (decode) W4A16 kernel: float32 multiply-adds on the CUDA cores, no tensor cores.

Program (column strip c, K split s) walks its groups of 128 input rows one per step: it loads the group's
`16 × block_n` words (each row of words one coalesced load), turns each nibble plane j into `f = 1 + q / 16`
(`nibbles.py`) and accumulates `x'_j · f_j` with `x'_j = 16 · x[8r + j]` (a strided load of x, broadcast over the
columns). Per word row r the zero point is folded in as one more multiply-add, `(Σ_j x'_j[r]) · (1 + z / 16)`, so
that `part[r, c] = Σ_j x_{8r+j} · (q − z)` exactly as the dequantized matmul; the group scale multiplies `part`
once per word. The accumulator keeps the 16 word rows apart; they are summed once, after the loop. With K split,
each split writes float32 partial sums and the caller adds them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.w4a16.nibbles import PACK, nibble_as_float


def _group_part(x_ref, row: int, words, group_index, zero, *, group: int):
    """`Σ_j x_{8r+j} (q_{8r+j} − z)` for the group's 16 word rows, `[16, block_n]` float32."""
    words_per_group = group // PACK
    part, x_rows = None, None
    for j in range(PACK):
        strided = pl.ds(group_index * group + j, words_per_group, stride=PACK)  # input rows 8r + j of the group
        xj = x_ref[jnp.int32(row), strided].astype(jnp.float32) * 16
        term = xj[:, None] * nibble_as_float(words, j)
        part = term if part is None else part + term
        x_rows = xj if x_rows is None else x_rows + xj
    return part - x_rows[:, None] * (1 + zero[None, :] / 16)


def gemv_kernel(x_ref, w_ref, z_ref, s_ref, y_ref, *, rows: int, block_n: int, group: int, groups_per_split: int,
                prefetch: bool):
    words_per_group = group // PACK
    cols = pl.ds(pl.multiple_of(pl.program_id(0) * block_n, block_n), block_n)
    first = pl.program_id(1) * groups_per_split

    def load_words(g):
        return w_ref[pl.ds(pl.multiple_of(g * words_per_group, words_per_group), words_per_group), cols]

    def accumulate(accs, g, words):
        zero = z_ref[g, cols].astype(jnp.float32)
        scale = s_ref[g, cols].astype(jnp.float32)[None, :]
        return tuple(acc + scale * _group_part(x_ref, r, words, g, zero, group=group) for r, acc in enumerate(accs))

    def step(i, accs):
        return accumulate(accs, first + i, load_words(first + i))

    def step_prefetching(i, carry):  # the next group's load is in flight while this one is used
        accs, words = carry
        upcoming = load_words(jnp.minimum(first + i + 1, first + groups_per_split - 1))
        return accumulate(accs, first + i, words), upcoming

    zeros = tuple(jnp.zeros((words_per_group, block_n), jnp.float32) for _ in range(rows))
    if prefetch:
        accs, _ = lax.fori_loop(0, groups_per_split, step_prefetching, (zeros, load_words(first)))
    else:
        accs = lax.fori_loop(0, groups_per_split, step, zeros)
    for r, acc in enumerate(accs):
        y_ref[pl.program_id(1), r, cols] = jnp.sum(acc, axis=0).astype(y_ref.dtype)


def gemv_call(x, packed, zeros, scales, *, group: int, block_n: int, split: int, num_warps: int, num_stages: int,
              prefetch: bool, interpret: bool):
    """`[split, m, n]` partial sums (float32 when split, else x's dtype)."""
    m, k = x.shape
    n = packed.shape[1]
    out_dtype = jnp.float32 if split > 1 else x.dtype
    kernel = functools.partial(gemv_kernel, rows=m, block_n=block_n, group=group,
                               groups_per_split=k // group // split, prefetch=prefetch)
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
