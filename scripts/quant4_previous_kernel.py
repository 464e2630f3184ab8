"""The first W4A16 kernel (one group per step, 8 dots of 16 rows each, narrow column strips, no K split), kept
only so that `quant4_sweep.py` times the current kernels against it in the same run."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr
from jaxtyping import Array, Float, Int

PACK = 8  # 4-bit values per int32 word


def _arange(start, size: int):
    return start + jnp.arange(size, dtype=jnp.int32)


def _kernel(x_ref, w_ref, z_ref, s_ref, y_ref, *, block_m: int, block_n: int, group: int):
    m_dim, k_dim = x_ref.shape
    rows = _arange(pl.program_id(0) * block_m, block_m)
    cols = _arange(pl.program_id(1) * block_n, block_n)
    in_m = rows[:, None] < m_dim
    words_per_group = group // PACK

    def step(g, acc):
        word_rows = _arange(g * words_per_group, words_per_group)
        words = pltr.load(w_ref.at[word_rows[:, None], cols[None, :]])
        zero = pltr.load(z_ref.at[g, cols]).astype(jnp.float32)
        scale = pltr.load(s_ref.at[g, cols]).astype(jnp.float32)
        for j in range(PACK):  # nibble plane j: input rows g·group + 8r + j
            q = ((words >> (4 * j)) & 15).astype(jnp.float32)
            w = ((q - zero[None, :]) * scale[None, :]).astype(x_ref.dtype)
            ks = g * group + _arange(0, words_per_group) * PACK + j
            x = pltr.load(x_ref.at[rows[:, None], ks[None, :]], mask=in_m, other=0)
            acc = acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
        return acc

    acc = lax.fori_loop(0, k_dim // group, step, jnp.zeros((block_m, block_n), jnp.float32))
    pltr.store(y_ref.at[rows[:, None], cols[None, :]], acc.astype(y_ref.dtype), mask=in_m)


@functools.partial(jax.jit, static_argnames=("group", "block_m", "block_n", "num_warps", "num_stages", "interpret"))
def previous_w4a16_matmul(
    x: Float[Array, "m k"], packed: Int[Array, "k8 n"], zeros: Float[Array, "g n"], scales: Float[Array, "g n"],
    *, group: int = 128, block_m: int = 16, block_n: int = 64, num_warps: int = 4, num_stages: int = 3,
    interpret: bool = False,
) -> Float[Array, "m n"]:
    """`x @ ((q − zeros[g]) · scales[g])` in x's dtype; decode: block_m 16; prefill: block_m 64, block_n 128."""
    m, k = x.shape
    n = packed.shape[1]
    if k % group or n % block_n or group % (16 * PACK) or packed.shape[0] * PACK != k:
        raise ValueError(f"w4a16_matmul needs k ({k}) a multiple of the group ({group}, itself of 128), n ({n}) of "
                         f"block_n ({block_n}) and packed rows = k / 8 (got {packed.shape[0]})")
    kernel = functools.partial(_kernel, block_m=block_m, block_n=block_n, group=group)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, block_m), n // block_n),
        in_specs=[pl.no_block_spec] * 4,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="w4a16_previous",
    )(x, packed, zeros, scales)
