"""The float8 (e4m3) KV-cache format the kernels share: values stored as `float8_e4m3fn`, one float32 scale per
(layer, K or V, KV head), `real value = stored value × scale`.

Quantizing multiplies by the reciprocal of the scale, clips to ±448 (the largest finite e4m3 value: the cast does not
saturate, it turns anything larger into NaN) and casts. The reciprocal is taken once, in XLA, outside any kernel, so
the Pallas write and the XLA scatter produce the same bytes (a division inside a Triton kernel may round differently
from XLA's).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448

KVScales = Float[Array, "layers 2 kv_heads"]


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.dtype(FP8_DTYPE)


def check_kv_scales(cache_shape: tuple[int, ...], cache_dtype, kv_scales) -> None:
    """A float8 cache needs `kv_scales [layers, 2, kv_heads]`; any other cache takes none. Raises ValueError."""
    layers, kv_heads = cache_shape[0], cache_shape[-2]
    if not is_fp8(cache_dtype):
        if kv_scales is not None:
            raise ValueError(f"kv_scales are only used with a float8_e4m3fn cache, not {jnp.dtype(cache_dtype)}")
        return
    if kv_scales is None:
        raise ValueError("a float8_e4m3fn KV cache needs kv_scales [layers, 2, kv_heads]")
    if tuple(kv_scales.shape) != (layers, 2, kv_heads):
        raise ValueError(f"kv_scales has shape {tuple(kv_scales.shape)}, expected {(layers, 2, kv_heads)}")


def quantize(x: Float[Array, "..."], inv_scale: Float[Array, "..."]) -> Float[Array, "..."]:
    """`x / scale` as e4m3, given `1 / scale` (broadcast against x): clip to ±448, then cast."""
    return jnp.clip(x.astype(jnp.float32) * inv_scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
