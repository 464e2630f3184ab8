"""The W4A16 kernel's reference, same signature: unpack the words, dequantize, one XLA matmul (the CPU path, and
the GPU's path for prefill-sized row counts)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.w4a16.nibbles import PACK


def unpack(packed: Int[Array, "k8 n"]) -> Int[Array, "k n"]:
    """Word (r, c) → input rows 8r … 8r + 7 of column c (row 8r + j at bits 4j)."""
    shifts = 4 * jnp.arange(PACK, dtype=jnp.int32)
    q = (packed[:, None, :] >> shifts[None, :, None]) & 15
    return q.reshape(-1, packed.shape[1])


def dequantized_matmul(x: Float[Array, "m k"], packed: Int[Array, "k8 n"], zeros: Float[Array, "g n"],
                       scales: Float[Array, "g n"], *, group: int) -> Float[Array, "m n"]:
    q = unpack(packed).astype(jnp.float32)
    rows = jnp.arange(q.shape[0]) // group
    w = ((q - zeros[rows].astype(jnp.float32)) * scales[rows].astype(jnp.float32)).astype(x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("group", "config", "interpret"))
def w4a16_matmul_reference(x: Float[Array, "m k"], packed: Int[Array, "k8 n"], zeros: Float[Array, "g n"],
                           scales: Float[Array, "g n"], *, group: int = 128, config=None,
                           interpret: bool = False) -> Float[Array, "m n"]:
    del config, interpret  # tiling knobs of the kernel
    return dequantized_matmul(x, packed, zeros, scales, group=group)
