"""The KV cache value the attention backends take and return: the paged array in the model dtype, or, with
`kv_cache_dtype="fp8"`, a `QuantizedKV` pytree: the same paged layout stored as float8_e4m3fn plus one float32 scale
per (layer, K/V, KV head). The pytree travels through the jitted step exactly like the plain array (from layer to
layer, donated as one argument), so no caller above the attention layer changes.

Scales (`real value = stored value × scale`) come from the checkpoint (`self_attn.k_scale` / `v_scale`, loaded as
the per-layer parameter `kv_scale`) or, without them, from the first step that writes real tokens: amax of that
step's K and V per layer and head ÷ 448, at least `SCALE_FLOOR`. A scale of 0 means "not set yet"; once set, every
later step uses it, and values beyond ±448 × scale are clipped (see `pallas_kernels.kv_quant`). Calibrated scales
depend on which requests the first step held, so a calibrated fp8 engine keeps the batch-invariance promise only
from that step on; checkpoint scales keep it throughout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int

from pallas_kernels.kv_quant import FP8_DTYPE, FP8_MAX, is_fp8

from jengine.config import KV_CACHE_DTYPES

FP8_NAMES = tuple(name for name in KV_CACHE_DTYPES if name != "auto")  # fp8, fp8_e4m3: the float8 cache
SCALE_FLOOR = 1e-6  # a head whose first K/V are all zero still gets a usable (non-zero) scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    kv: Float[Array, "layers blocks block_size 2 kv_heads head_dim"]  # float8_e4m3fn, the documented paged layout
    scales: Float[Array, "layers 2 kv_heads"]  # float32; axis 1: 0 = K, 1 = V; 0 until set

    @property
    def shape(self) -> tuple[int, ...]:
        return self.kv.shape

    @property
    def dtype(self):
        return self.kv.dtype


KVCache = Float[Array, "layers blocks block_size 2 kv_heads head_dim"] | QuantizedKV


def cache_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    """The element type of the cache: the model's for `auto`, float8_e4m3fn for `fp8` / `fp8_e4m3`."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype in FP8_NAMES:
        return jnp.dtype(FP8_DTYPE)
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: choose auto, {' or '.join(FP8_NAMES)}")


def allocate(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding | None = None) -> KVCache:
    """Zeros of `shape` (scales unset for a float8 cache), placed by `sharding` (the scales follow its KV-head axis)."""
    if not is_fp8(dtype):
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
    scales_shape = (shape[0], 2, shape[-2])
    shardings = None if sharding is None else QuantizedKV(sharding, _scales_sharding(sharding))
    return jax.jit(lambda: QuantizedKV(jnp.zeros(shape, dtype), jnp.zeros(scales_shape, jnp.float32)),
                   out_shardings=shardings)()


def _scales_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (6 - len(sharding.spec))
        return NamedSharding(sharding.mesh, P(None, None, spec[4]))
    return sharding


def partition_spec(kv_cache: KVCache, head_axis: str | None) -> P | QuantizedKV:
    """The `shard_map` spec of the cache split over `head_axis` (None: replicated), a pytree for `QuantizedKV`."""
    kv = P(None, None, None, None, head_axis, None) if head_axis else P()
    if isinstance(kv_cache, QuantizedKV):
        return QuantizedKV(kv, P(None, None, head_axis) if head_axis else P())
    return kv


def calibrate(
    cache: QuantizedKV,
    layer: Int[Array, ""],
    k: Float[Array, "tokens kv_heads head_dim"],
    v: Float[Array, "tokens kv_heads head_dim"],
    slot_mapping: Int[Array, " tokens"],
    checkpoint_scales: Float[Array, "2 kv_heads"] | None = None,
) -> QuantizedKV:
    """Sets `layer`'s scales if they are unset and this step writes real tokens: the checkpoint's when given, else
    amax of this step's K/V per head ÷ 448. Set scales are kept. Runs in every step (a select, no branch: a
    data-dependent branch would cost a device→host round trip per layer on GPUs)."""
    num_slots = cache.kv.shape[1] * cache.kv.shape[2]
    real = (slot_mapping >= 0) & (slot_mapping < num_slots)
    if checkpoint_scales is None:
        amax = jnp.stack([_amax(k, real), _amax(v, real)])
        fresh = jnp.maximum(amax / FP8_MAX, SCALE_FLOOR)
    else:
        fresh = checkpoint_scales.astype(jnp.float32)
    current = cache.scales[layer]
    new = jnp.where((current > 0) | ~jnp.any(real), current, fresh)
    return dataclasses.replace(cache, scales=cache.scales.at[layer].set(new))


def _amax(x: Float[Array, "tokens kv_heads head_dim"], real) -> Float[Array, " kv_heads"]:
    return jnp.max(jnp.where(real[:, None, None], jnp.abs(x.astype(jnp.float32)), 0.0), axis=(0, 2))


def parts(kv_cache: KVCache) -> tuple[Array, Float[Array, "layers 2 kv_heads"] | None]:
    """(paged array, scales or None): what the kernels take."""
    if isinstance(kv_cache, QuantizedKV):
        return kv_cache.kv, kv_cache.scales
    return kv_cache, None
