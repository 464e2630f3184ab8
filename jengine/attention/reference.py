"""Pure-jnp paged attention: the oracle for the kernels and the path on platforms without one.

KV-cache layout (docs/ARCHITECTURE.md): one array `[num_layers, num_blocks, block_size, 2, num_kv_heads, head_dim]`,
K at index 0 and V at index 1 of axis 3, so one page of one layer (all heads, K and V) is contiguous. A float8
cache (`QuantizedKV`) is written quantized with its layer's scales and read back dequantized to float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.kv_quant import quantize

from jengine.attention.kv_cache import KVCache, QuantizedKV
from jengine.attention.metadata import AttentionMetadata


def write_kv(
    kv_cache: KVCache,
    layer: Int[Array, ""],
    slot_mapping: Int[Array, " tokens"],
    k: Float[Array, "tokens kv_heads head_dim"],
    v: Float[Array, "tokens kv_heads head_dim"],
) -> KVCache:
    """Writes new K/V into their slots in place (the cache is donated by the step); out-of-range slots are dropped.
    A float8 cache stores them divided by the layer's scales (which must be set: see `kv_cache.calibrate`)."""
    new = jnp.stack([k, v], axis=1)
    if isinstance(kv_cache, QuantizedKV):
        inv = 1.0 / kv_cache.scales[layer]
        return dataclasses.replace(kv_cache, kv=_scatter(kv_cache.kv, layer, slot_mapping,
                                                         quantize(new, inv[None, :, :, None])))
    return _scatter(kv_cache, layer, slot_mapping, new)


def _scatter(kv, layer, slot_mapping, new):
    layers, blocks, block_size, two, heads, dim = kv.shape
    flat = kv.reshape(layers, blocks * block_size, two, heads, dim)
    flat = flat.at[layer, slot_mapping].set(new.astype(kv.dtype), mode="drop")
    return flat.reshape(kv.shape)


def paged_attention(
    q: Float[Array, "tokens q_heads head_dim"],
    kv_cache: KVCache,
    layer: Int[Array, ""],
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: Int[Array, ""] | int = 0,
    soft_cap: float | None = None,
) -> Float[Array, "tokens q_heads head_dim"]:
    """Causal attention of each new token over its own request's cached tokens (which include this step's).

    Queries are regrouped per request into `[seqs, max_query_len]`, so the work is seqs × max_query_len × context,
    never tokens × all contexts. `sliding_window` > 0 keeps the last `sliding_window` positions (HF's rule).
    """
    num_tokens, q_heads, head_dim = q.shape
    _, _, block_size, _, kv_heads, _ = kv_cache.shape
    group = q_heads // kv_heads
    seqs, width = md.block_tables.shape
    q_len = md.query_start_loc[1:] - md.query_start_loc[:-1]

    # Per-request padded queries: token index of (request b, i-th new token).
    offsets = jnp.arange(md.max_query_len, dtype=jnp.int32)
    token_idx = md.query_start_loc[:-1, None] + offsets[None, :]
    q_valid = offsets[None, :] < q_len[:, None]
    token_idx = jnp.where(q_valid, token_idx, 0)
    q_seq = q[token_idx].reshape(seqs, md.max_query_len, kv_heads, group, head_dim)
    q_pos = md.seq_lens[:, None] - q_len[:, None] + offsets[None, :]

    pages = _gather_pages(kv_cache, layer, md.block_tables)
    k, v = pages[:, :, 0], pages[:, :, 1]

    scores = jnp.einsum("bqhgd,bshd->bhgqs", q_seq, k, preferred_element_type=jnp.float32, precision="highest")
    scores = scores * scale
    if soft_cap:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    k_pos = jnp.arange(width * block_size, dtype=jnp.int32)
    visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < md.seq_lens[:, None, None])
    window = jnp.asarray(sliding_window, jnp.int32)
    visible &= (window <= 0) | (k_pos[None, None, :] > q_pos[:, :, None] - window)
    visible &= q_valid[:, :, None]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgqs,bshd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32,
                     precision="highest")
    out = out.reshape(seqs, md.max_query_len, q_heads, head_dim)

    # Back to the flattened token order; padding tokens read row 0 and are ignored downstream.
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of_token = jnp.clip(jnp.searchsorted(md.query_start_loc[1:], token, side="right"), 0, seqs - 1)
    index_in_seq = jnp.clip(token - md.query_start_loc[seq_of_token], 0, md.max_query_len - 1)
    return out[seq_of_token, index_in_seq].astype(q.dtype)


def _gather_pages(kv_cache: KVCache, layer, block_tables) -> Float[Array, "seqs context 2 kv_heads head_dim"]:
    """Each request's pages of `layer` in position order; a float8 cache dequantized to float32."""
    quantized = isinstance(kv_cache, QuantizedKV)
    kv = kv_cache.kv if quantized else kv_cache
    _, _, block_size, _, kv_heads, head_dim = kv.shape
    seqs, width = block_tables.shape
    layer_cache = jax.lax.dynamic_index_in_dim(kv, layer, axis=0, keepdims=False)
    pages = layer_cache[block_tables].reshape(seqs, width * block_size, 2, kv_heads, head_dim)
    if quantized:
        return pages.astype(jnp.float32) * kv_cache.scales[layer][None, None, :, :, None]
    return pages
