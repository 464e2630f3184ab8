"""Pure-jnp ragged paged attention with the kernel's signature: the oracle its tests and benchmarks compare against.

Same semantics as jengine's `attention.reference.paged_attention` (which this package may not import): queries are
regrouped per request into `[seqs, max_query_len]`, K/V gathered through the block table, a dense masked softmax in
float32. One deliberate difference: rows of padding tokens are zeros here, as in the kernel, so whole outputs compare.
A float8 cache is dequantized to float32 (stored value × scale) after the gather, before any arithmetic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.kv_quant import KVScales, check_kv_scales

KVCache = Float[Array, "layers blocks block_size 2 kv_heads head_dim"]


def _regroup_queries(q, query_start_loc, max_query_len: int, kv_heads: int):
    """`[tokens, q_heads, d]` → `[seqs, max_query_len, kv_heads, group, d]` and the validity mask of each slot."""
    seqs = query_start_loc.shape[0] - 1
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    offsets = jnp.arange(max_query_len, dtype=jnp.int32)
    valid = offsets[None, :] < q_len[:, None]
    token_idx = jnp.where(valid, query_start_loc[:-1, None] + offsets[None, :], 0)
    num_tokens, q_heads, head_dim = q.shape
    grouped = q[token_idx].reshape(seqs, max_query_len, kv_heads, q_heads // kv_heads, head_dim)
    return grouped, valid


def _visible(q_pos, seq_lens, valid, sliding_window, context: int):
    """`[seqs, max_query_len, context]`: causal, inside the request, inside the window (window <= 0: no window)."""
    k_pos = jnp.arange(context, dtype=jnp.int32)[None, None, :]
    visible = (k_pos <= q_pos[:, :, None]) & (k_pos < seq_lens[:, None, None])
    window = jnp.asarray(sliding_window, jnp.int32)
    visible &= (window <= 0) | (k_pos > q_pos[:, :, None] - window)
    return visible & valid[:, :, None]


def _softmax(scores, visible):
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    return probs / jnp.where(denom > 0, denom, 1.0)


def _scatter_back(out, query_start_loc, num_tokens: int, max_query_len: int):
    """`[seqs, max_query_len, q_heads, d]` → flat token order; padding tokens get zeros."""
    seqs = query_start_loc.shape[0] - 1
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of_token = jnp.clip(jnp.searchsorted(query_start_loc[1:], token, side="right"), 0, seqs - 1)
    index_in_seq = jnp.clip(token - query_start_loc[seq_of_token], 0, max_query_len - 1)
    flat = out[seq_of_token, index_in_seq]
    is_real = token < query_start_loc[-1]
    return jnp.where(is_real[:, None, None], flat, 0)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "max_query_len", "interpret"))
def ragged_paged_attention(
    q: Float[Array, "tokens q_heads head_dim"],
    kv_cache: KVCache,
    layer: Int[Array, ""] | int,
    query_start_loc: Int[Array, " seqs_plus_1"],
    seq_lens: Int[Array, " seqs"],
    block_tables: Int[Array, "seqs blocks_per_seq"],
    *,
    kv_scales: KVScales | None = None,
    scale: float,
    sliding_window: Int[Array, ""] | int = 0,
    soft_cap: float | None = None,
    max_query_len: int,
    interpret: bool = False,  # signature parity with the kernel; the reference runs anywhere
) -> Float[Array, "tokens q_heads head_dim"]:
    """Each new token attends causally over its own request's cached positions; see `kernel.ragged_paged_attention`."""
    del interpret
    check_kv_scales(kv_cache.shape, kv_cache.dtype, kv_scales)
    num_tokens, q_heads, head_dim = q.shape
    _, _, block_size, _, kv_heads, _ = kv_cache.shape
    seqs, width = block_tables.shape
    q_seq, valid = _regroup_queries(q, query_start_loc, max_query_len, kv_heads)
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    q_pos = seq_lens[:, None] - q_len[:, None] + jnp.arange(max_query_len, dtype=jnp.int32)[None, :]

    layer = jnp.asarray(layer, jnp.int32)
    layer_cache = jax.lax.dynamic_index_in_dim(kv_cache, layer, axis=0, keepdims=False)
    pages = layer_cache[block_tables].reshape(seqs, width * block_size, 2, kv_heads, head_dim)
    if kv_scales is not None:
        pages = pages.astype(jnp.float32) * kv_scales[layer].astype(jnp.float32)[None, None, :, :, None]
    k, v = pages[:, :, 0], pages[:, :, 1]

    scores = jnp.einsum("bqhgd,bshd->bhgqs", q_seq, k, preferred_element_type=jnp.float32, precision="highest")
    scores = scores * scale
    if soft_cap:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    probs = _softmax(scores, _visible(q_pos, seq_lens, valid, sliding_window, width * block_size))
    out = jnp.einsum("bhgqs,bshd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32,
                     precision="highest")
    out = out.reshape(seqs, max_query_len, q_heads, head_dim)
    return _scatter_back(out, query_start_loc, num_tokens, max_query_len).astype(q.dtype)
