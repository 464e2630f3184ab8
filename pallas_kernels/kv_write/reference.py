"""XLA scatter with the kernel's signature: the oracle for `kernel.write_kv`, and the path the GPU backend uses
(inside the jitted step the scatter is fused and in place, and it measured as fast as the kernel: see kernel.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

KVCache = Float[Array, "layers blocks block_size 2 kv_heads head_dim"]


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("kv_cache",))
def write_kv(
    kv_cache: KVCache,
    layer: Int[Array, ""] | int,
    slot_mapping: Int[Array, " tokens"],
    k: Float[Array, "tokens kv_heads head_dim"],
    v: Float[Array, "tokens kv_heads head_dim"],
    *,
    interpret: bool = False,  # signature parity with the kernel; the reference runs anywhere
) -> KVCache:
    """Slot s = block * block_size + offset; slots outside `[0, num_slots)` (padding uses num_slots) are dropped."""
    del interpret
    layers, blocks, block_size, two, heads, dim = kv_cache.shape
    flat = kv_cache.reshape(layers, blocks * block_size, two, heads, dim)
    slots = jnp.where(slot_mapping < 0, blocks * block_size, slot_mapping)  # negative indices would wrap
    new = jnp.stack([k, v], axis=1).astype(kv_cache.dtype)
    flat = flat.at[jnp.asarray(layer, jnp.int32), slots].set(new, mode="drop")
    return flat.reshape(kv_cache.shape)
