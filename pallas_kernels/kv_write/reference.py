"""XLA scatter with the kernel's signature: the oracle for `kernel.write_kv`, and the path the GPU backend uses
(inside the jitted step the scatter is fused and in place, and it measured as fast as the kernel: see kernel.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.kv_quant import KVScales, check_kv_scales, quantize

KVCache = Float[Array, "layers blocks block_size 2 kv_heads head_dim"]


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("kv_cache",))
def write_kv(
    kv_cache: KVCache,
    layer: Int[Array, ""] | int,
    slot_mapping: Int[Array, " tokens"],
    k: Float[Array, "tokens kv_heads head_dim"],
    v: Float[Array, "tokens kv_heads head_dim"],
    *,
    kv_scales: KVScales | None = None,
    interpret: bool = False,  # signature parity with the kernel; the reference runs anywhere
) -> KVCache:
    """Slot s = block * block_size + offset; slots outside `[0, num_slots)` (padding uses num_slots) are dropped.
    A float8 cache stores `k / kv_scales[layer, 0, head]` (and V likewise), clipped to ±448."""
    del interpret
    check_kv_scales(kv_cache.shape, kv_cache.dtype, kv_scales)
    layers, blocks, block_size, two, heads, dim = kv_cache.shape
    flat = kv_cache.reshape(layers, blocks * block_size, two, heads, dim)
    slots = jnp.where(slot_mapping < 0, blocks * block_size, slot_mapping)  # negative indices would wrap
    layer = jnp.asarray(layer, jnp.int32)
    new = jnp.stack([k, v], axis=1)
    if kv_scales is not None:
        inv = 1.0 / kv_scales.astype(jnp.float32)
        new = quantize(new, inv[layer][None, :, :, None])
    flat = flat.at[layer, slots].set(new.astype(kv_cache.dtype), mode="drop")
    return flat.reshape(kv_cache.shape)
