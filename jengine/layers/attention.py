"""The model-facing attention call: projections, q/k norms, rotary, then the chosen paged backend.

With a float8 cache the layer's K/V scales are settled here, before the backend writes: from the checkpoint's
`kv_scale` parameter when the model has one, else calibrated from the first step's K/V (`attention/kv_cache.py`).
"""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from jengine.attention.backend import AttentionBackend
from jengine.attention.kv_cache import KVCache, QuantizedKV, allocate, calibrate
from jengine.attention.metadata import AttentionMetadata
from jengine.layers.linear import Precision, linear, split_fused
from jengine.layers.lora import LayerLora
from jengine.layers.norm import rms_norm_pair
from jengine.layers.rotary import apply_rotary
from jengine.models.spec import ModelSpec


def self_attention(
    spec: ModelSpec,
    w: dict[str, Array],
    x: Float[Array, "tokens d"],
    kv_cache: KVCache,
    layer: Int[Array, ""],
    window: Int[Array, ""],
    md: AttentionMetadata,
    rope: tuple[Float[Array, " half_rot"], float],
    backend: AttentionBackend,
    precision: Precision = None,
    lora: LayerLora | None = None,
) -> tuple[Float[Array, "tokens d"], KVCache]:
    """`lora`: the rows' adapters add to the q/k/v and o projections (`layers/lora.py`)."""
    tokens, hd = x.shape[0], spec.head_dim
    widths = (spec.num_heads * hd, spec.num_kv_heads * hd, spec.num_kv_heads * hd)
    if lora is None:
        qkv = linear(x, w["wqkv"], w.get("bqkv"), precision)
    else:
        qkv = lora.project("qkv", x, w["wqkv"], w.get("bqkv"), precision)
    q, k, v = split_fused(qkv, widths, spec.projection_shards)
    q = q.reshape(tokens, spec.num_heads, hd)
    k, v = (a.reshape(tokens, spec.num_kv_heads, hd) for a in (k, v))
    if spec.qk_norm:  # Qwen3: RMSNorm over each head before the rotation
        q, k = rms_norm_pair(q, k, w["q_norm"], w["k_norm"], spec.rms_norm_eps)
    inv_freq, scaling = rope
    q = apply_rotary(q, md.positions, inv_freq, scaling)
    k = apply_rotary(k, md.positions, inv_freq, scaling)
    if isinstance(kv_cache, QuantizedKV):
        kv_cache = calibrate(kv_cache, layer, k, v, md.slot_mapping, w.get("kv_scale"))
    out, kv_cache = backend(
        q, k, v, kv_cache, layer, md,
        scale=hd**-0.5, sliding_window=window, soft_cap=spec.attn_logit_softcap,
    )
    out = out.reshape(tokens, spec.num_heads * hd)
    if lora is None:
        projected = linear(out, w["wo"], w.get("bo"), precision)
    else:
        projected = lora.project("o", out, w["wo"], w.get("bo"), precision)
    return projected, kv_cache


def kv_cache_shape(spec: ModelSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The paged layout of docs/ARCHITECTURE.md: [layers, blocks, block_size, 2 (K, V), kv_heads, head_dim]."""
    return (spec.num_layers, num_blocks, block_size, 2, spec.num_kv_heads, spec.head_dim)


def allocate_kv_cache(spec: ModelSpec, num_blocks: int, block_size: int, dtype) -> KVCache:
    """Zeros in `dtype`; float8_e4m3fn gives a `QuantizedKV` whose scales are set by the first step."""
    return allocate(kv_cache_shape(spec, num_blocks, block_size), dtype)
