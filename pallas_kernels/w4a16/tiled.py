"""The tensor-core W4A16 kernel (tens of rows and up): program (row tile, column tile, K split) walks its K range in
steps of `block_k` input rows; each step loads the `block_k / 8 × block_n` words, turns all 8 nibble planes into
`1 + q / 16` at once (`nibbles.py`, `[r, 8, c]`, which merges into the rows' natural order, so x is read as it is),
dequantizes with one multiply-add, `(1 + q / 16) · 16s − s(16 + z) = (q − z) · s` (the same bfloat16 weight the
reference builds), and multiplies on the tensor cores into a float32 accumulator. Rows beyond m are masked.
`planes=True` skips the merge instead: 8 dots per step, nibble plane j (`block_k / 8` rows) against columns
8r + j of x, which the wrapper has permuted so that each step's plane j is one contiguous slice (`plane_major`),
for when Triton's layout conversion of the merged tile costs more than the smaller dots."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.w4a16.nibbles import PACK, affine, nibble_as_float, nibbles_as_float


def _arange(start, size: int):
    return start + jnp.arange(size, dtype=jnp.int32)


def _affine(z_ref, s_ref, k0, cols, *, block_k: int, group: int):
    """(16s, −s(16 + z)) for the step's word rows: `[1, 1, block_n]` within one group, else `[r, 1, block_n]`."""
    if block_k <= group:
        index = (k0 // group, cols)
    else:
        index = ((k0 // group + jnp.arange(block_k // PACK, dtype=jnp.int32) // (group // PACK))[:, None],
                 cols[None, :])
    zero = pltr.load(z_ref.at[index]).astype(jnp.float32)
    scale = pltr.load(s_ref.at[index]).astype(jnp.float32)
    if block_k <= group:
        zero, scale = zero[None, :], scale[None, :]
    return affine(zero, scale)


def _merged_step(x_ref, words, a, b, rows, in_m, k0, *, block_k: int):
    w = (nibbles_as_float(words) * a + b).reshape(block_k, words.shape[1]).astype(x_ref.dtype)
    x = pltr.load(x_ref.at[rows[:, None], _arange(k0, block_k)[None, :]], mask=in_m, other=0)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def plane_major(x, block_k: int):
    """x's columns reordered within each `block_k` chunk: chunk column j·(block_k/8) + r holds input row 8r + j."""
    m, k = x.shape
    return x.reshape(m, k // block_k, block_k // PACK, PACK).transpose(0, 1, 3, 2).reshape(m, k)


def _planes_step(x_ref, words, a, b, rows, in_m, k0, *, block_k: int):
    part, plane_rows = None, block_k // PACK
    for j in range(PACK):
        w = (nibble_as_float(words, j) * a[:, 0] + b[:, 0]).astype(x_ref.dtype)
        x = pltr.load(x_ref.at[rows[:, None], _arange(k0 + j * plane_rows, plane_rows)[None, :]], mask=in_m, other=0)
        term = jnp.dot(x, w, preferred_element_type=jnp.float32)
        part = term if part is None else part + term
    return part


def dot_kernel(x_ref, w_ref, z_ref, s_ref, y_ref, *, block_m: int, block_n: int, block_k: int, group: int,
               steps_per_split: int, planes: bool):
    m_dim = x_ref.shape[0]
    rows = _arange(pl.program_id(0) * block_m, block_m)
    cols = _arange(pl.program_id(1) * block_n, block_n)
    in_m = rows[:, None] < m_dim
    first = pl.program_id(2) * steps_per_split
    multiply = _planes_step if planes else _merged_step

    def step(i, acc):
        k0 = pl.multiple_of((first + i) * block_k, block_k)
        words = pltr.load(w_ref.at[_arange(k0 // PACK, block_k // PACK)[:, None], cols[None, :]])
        a, b = _affine(z_ref, s_ref, k0, cols, block_k=block_k, group=group)
        return acc + multiply(x_ref, words, a, b, rows, in_m, k0, block_k=block_k)

    acc = lax.fori_loop(0, steps_per_split, step, jnp.zeros((block_m, block_n), jnp.float32))
    pltr.store(y_ref.at[pl.program_id(2), rows[:, None], cols[None, :]], acc.astype(y_ref.dtype), mask=in_m)


def dot_call(x, packed, zeros, scales, *, group: int, block_m: int, block_n: int, block_k: int, split: int,
             num_warps: int, num_stages: int, planes: bool, interpret: bool):
    """`[split, m, n]` partial sums (float32 when split, else x's dtype)."""
    m, k = x.shape
    n = packed.shape[1]
    kernel = functools.partial(dot_kernel, block_m=block_m, block_n=block_n, block_k=block_k, group=group,
                               steps_per_split=k // block_k // split, planes=planes)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, block_m), n // block_n, split),
        in_specs=[pl.no_block_spec] * 4,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((split, m, n), jnp.float32 if split > 1 else x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="w4a16_dot",
    )(plane_major(x, block_k) if planes else x, packed, zeros, scales)
