"""`x @ w` (or `x @ wᵀ`) with a row's result independent of the other rows: batch invariance.

cuBLAS and XLA pick a GEMM algorithm (tile shape, split-K, stream-K) by the problem's shape, so a token's logits
change with the number of rows beside it. Here one tile configuration serves every row count: programs of
`TILE.block_m × TILE.block_n` outputs walk K in steps of `TILE.block_k` from 0 upwards, each step one tensor-core dot
accumulated into float32, never split across programs. The order of a row's sum — and the instructions computing it,
since the tile shape is fixed — is then the same whether the row is alone or one of thousands; rows past `m` are
masked, never computed into the real rows. Ragged K and N edges are zero-masked.

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


TILE = Tile()  # one configuration for every shape: the point of the kernel


def _arange(start, size: int):
    return start + jnp.arange(size, dtype=jnp.int32)


def _kernel(x_ref, w_ref, y_ref, *, tile: Tile, transposed: bool):
    m_dim, k_dim = x_ref.shape
    n_dim = w_ref.shape[0] if transposed else w_ref.shape[1]
    rows = _arange(pl.program_id(0) * tile.block_m, tile.block_m)
    cols = _arange(pl.program_id(1) * tile.block_n, tile.block_n)

    def step(i, acc):
        ks = _arange(i * tile.block_k, tile.block_k)
        x = pltr.load(x_ref.at[rows[:, None], ks[None, :]], mask=(rows[:, None] < m_dim) & (ks[None, :] < k_dim),
                      other=0)
        if transposed:  # w [n, k]
            w = pltr.load(w_ref.at[cols[:, None], ks[None, :]],
                          mask=(cols[:, None] < n_dim) & (ks[None, :] < k_dim), other=0).T
        else:
            w = pltr.load(w_ref.at[ks[:, None], cols[None, :]],
                          mask=(ks[:, None] < k_dim) & (cols[None, :] < n_dim), other=0)
        return acc + jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, pl.cdiv(k_dim, tile.block_k), step,
                        jnp.zeros((tile.block_m, tile.block_n), jnp.float32))
    pltr.store(y_ref.at[rows[:, None], cols[None, :]], acc.astype(y_ref.dtype),
               mask=(rows[:, None] < m_dim) & (cols[None, :] < n_dim))


@functools.partial(jax.jit, static_argnames=("transposed", "out_dtype", "interpret"))
def invariant_matmul(
    x: Float[Array, "m k"], w: Float[Array, "k n"] | Float[Array, "n k"], *, transposed: bool = False,
    out_dtype=None, interpret: bool = False,
) -> Float[Array, "m n"]:
    """`x @ w` (`transposed`: `x @ w.T` for w `[n, k]`, the LM head's layout), in `out_dtype` (x's by default)."""
    m = x.shape[0]
    n = w.shape[0] if transposed else w.shape[1]
    kernel = functools.partial(_kernel, tile=TILE, transposed=transposed)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, TILE.block_m), pl.cdiv(n, TILE.block_n)),
        in_specs=[pl.no_block_spec] * 2,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype or x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=TILE.num_warps, num_stages=TILE.num_stages),
        interpret=interpret,
        name="invariant_matmul",
    )(x, w)
