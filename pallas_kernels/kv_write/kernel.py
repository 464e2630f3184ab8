"""In-place K/V write into the paged cache (Pallas, Triton backend, `input_output_aliases`).

Each program copies `tokens_per_program` tokens: it loads their slots, then stores each token's K row and V row
(`kv_heads * head_dim` contiguous elements each) at `[layer, slot, 0|1]` of the cache viewed as
`[layers, num_slots, 2, kv_heads * head_dim]` (a free reshape). Padding tokens carry slot `num_slots` and are
masked out, as are any other slot outside `[0, num_slots)`. A float8 cache is written quantized in registers: each
element times the reciprocal scale of its (layer, K/V, head), clipped to ±448, cast (`pallas_kernels.kv_quant`).

Why it exists next to the XLA scatter in `reference.py`: `scripts/bench_kernels.py` times both inside one jit over 32
layers, unrolled as in the step (an H100, benchmarks/results/2026-12-07-kernels-13bb250.json): at 64 tokens this
kernel took 103 µs at one token a program against the scatter's 146, at 2048 tokens 224 µs (243 at eight) against
1311, so jengine's `attention/pallas.py` picks it, and its `tokens_per_program`, by the static token bucket. A float8
cache of (2, 4] GiB is refused here (single-byte stores, `pallas_kernels/addressing.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr
from jaxtyping import Array, Float, Int

from pallas_kernels.addressing import check_addressable, next_pow2
from pallas_kernels.kv_quant import FP8_MAX, KVScales, check_kv_scales

KVCache = Float[Array, "layers blocks block_size 2 kv_heads head_dim"]


def _kv_write_kernel(layer_ref, slots_ref, k_ref, v_ref, inv_ref, cache_in_ref, cache_ref, *, tokens_per_program: int,
                     row_pad: int, head_dim: int, quantized: bool):
    """Scatter of `tokens_per_program` K and V rows; every index is an array or scalar (interpret-mode gathers).
    `inv_ref`: flattened `1 / kv_scales` `[layers * 2 * kv_heads]` (read only when `quantized`)."""
    del cache_in_ref  # the same buffer as cache_ref (aliased)
    num_tokens, row = k_ref.shape
    num_slots = cache_ref.shape[1]
    t = pl.program_id(0) * tokens_per_program + jnp.arange(tokens_per_program, dtype=jnp.int32)
    t_ok = t < num_tokens
    slot = pltr.load(slots_ref.at[jnp.where(t_ok, t, 0)], mask=t_ok, other=num_slots)
    ok = t_ok & (slot >= 0) & (slot < num_slots)
    cols = jnp.arange(row_pad, dtype=jnp.int32)[None, :]
    mask = ok[:, None] & (cols < row)
    src = jnp.where(ok, t, 0)[:, None]
    dst = jnp.where(ok, slot, num_slots)[:, None]  # masked rows point past the end: dropped in interpret mode too
    layer = layer_ref[0]
    for kv, ref in ((0, k_ref), (1, v_ref)):
        val = pltr.load(ref.at[src, cols], mask=mask, other=0)
        if quantized:
            heads = row // head_dim
            head = jnp.minimum(cols // head_dim, heads - 1)
            inv = pltr.load(inv_ref.at[(layer * 2 + kv) * heads + head], mask=cols < row, other=0.0)
            val = jnp.clip(val.astype(jnp.float32) * inv, -FP8_MAX, FP8_MAX)
        pltr.store(cache_ref.at[layer, dst, kv, cols], val.astype(cache_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("interpret", "tokens_per_program"), donate_argnames=("kv_cache",))
def write_kv(
    kv_cache: KVCache,
    layer: Int[Array, ""] | int,
    slot_mapping: Int[Array, " tokens"],
    k: Float[Array, "tokens kv_heads head_dim"],
    v: Float[Array, "tokens kv_heads head_dim"],
    *,
    kv_scales: KVScales | None = None,
    interpret: bool = False,
    tokens_per_program: int = 8,
) -> KVCache:
    """Writes `k`/`v` at `[layer, slot // block_size, slot % block_size]`; out-of-range slots are dropped. The cache
    is updated in place when donated (here, or by the enclosing jitted step). A float8 cache needs `kv_scales`
    (positive) and stores `k / kv_scales[layer, 0, head]`, `v / kv_scales[layer, 1, head]`, clipped to ±448.
    Outside interpret mode, a cache the lowering's 32-bit offsets cannot address raises `UnsupportedShapeError`."""
    check_kv_scales(kv_cache.shape, kv_cache.dtype, kv_scales)
    if not interpret:
        check_addressable(kv_cache.shape, kv_cache.dtype)
    layers, blocks, block_size, two, heads, dim = kv_cache.shape
    num_tokens = k.shape[0]
    cache = kv_cache.reshape(layers, blocks * block_size, two, heads * dim)
    quantized = kv_scales is not None
    inv = (1.0 / kv_scales.astype(jnp.float32)).reshape(-1) if quantized else jnp.ones((1,), jnp.float32)
    kernel = functools.partial(_kv_write_kernel, tokens_per_program=tokens_per_program,
                               row_pad=next_pow2(heads * dim), head_dim=dim, quantized=quantized)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, tokens_per_program),),
        in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        input_output_aliases={5: 0},
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kv_write",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        jnp.asarray(slot_mapping, jnp.int32),
        k.reshape(num_tokens, heads * dim),
        v.reshape(num_tokens, heads * dim),
        inv,
        cache,
    )
    return out.reshape(kv_cache.shape)
