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


# Bytes a step's attention may hold at once (scores, probabilities, gathered pages): above it, the tokens are
# attended a chunk at a time. Compile-time shapes only, so it bounds every bucket the engine warms up.
WORKING_SET_BYTES = 256 << 20


def paged_attention(
    q: Float[Array, "tokens q_heads head_dim"],
    kv_cache: KVCache,
    layer: Int[Array, ""],
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: Int[Array, ""] | int = 0,
    soft_cap: float | None = None,
    working_set_bytes: int = WORKING_SET_BYTES,
) -> Float[Array, "tokens q_heads head_dim"]:
    """Causal attention of each new token over its own request's cached tokens (which include this step's).
    `sliding_window` > 0 keeps the last `sliding_window` positions (HF's rule).

    Two layouts of the same arithmetic, chosen from the step's static shapes. Per request: queries regrouped into
    `[seqs, max_query_len]` against each request's pages gathered once; its work and memory are seqs ×
    max_query_len × context. Per token, in chunks: each token against its request's pages; its work is tokens ×
    context and its memory a chunk's. The first is taken wherever it fits `working_set_bytes` (so the step shapes
    of tests and small models keep the arithmetic they always had); a bucket mixing many requests with one long
    prefill (seqs × max_query_len ≫ tokens) or a long context takes the second, so no step shape asks for more
    than about `working_set_bytes`. The two may differ in the last bits (their dot products have other shapes).
    """
    seqs, width = md.block_tables.shape
    context = width * kv_cache.shape[2]
    padded_queries = seqs * md.max_query_len
    per_request_bytes = padded_queries * _query_bytes(q, context) + seqs * _page_bytes(kv_cache, context)
    if per_request_bytes <= working_set_bytes:
        return _per_request(q, kv_cache, layer, md, scale, sliding_window, soft_cap)
    chunk = max(1, working_set_bytes // (_query_bytes(q, context) + _page_bytes(kv_cache, context)))
    return _per_token(q, kv_cache, layer, md, scale, sliding_window, soft_cap, min(chunk, q.shape[0]))


def _query_bytes(q, context: int) -> int:
    """One query row's float32 scores, mask and probabilities over `context` positions, every head."""
    return 3 * 4 * q.shape[1] * context


def _page_bytes(kv_cache: KVCache, context: int) -> int:
    """One request's gathered K and V over `context` positions, counted twice: the gather and the K and V
    operands taken from it (float32 where a float8 cache is dequantized)."""
    _, _, _, two, kv_heads, head_dim = kv_cache.shape
    itemsize = 4 if isinstance(kv_cache, QuantizedKV) else jnp.dtype(kv_cache.dtype).itemsize
    return 2 * context * two * kv_heads * head_dim * itemsize


def _per_request(q, kv_cache, layer, md: AttentionMetadata, scale, sliding_window, soft_cap):
    num_tokens, q_heads, head_dim = q.shape
    kv_heads = kv_cache.shape[4]
    seqs = md.seq_lens.shape[0]
    q_len = md.query_start_loc[1:] - md.query_start_loc[:-1]

    # Per-request padded queries: token index of (request b, i-th new token).
    offsets = jnp.arange(md.max_query_len, dtype=jnp.int32)
    token_idx = md.query_start_loc[:-1, None] + offsets[None, :]
    q_valid = offsets[None, :] < q_len[:, None]
    token_idx = jnp.where(q_valid, token_idx, 0)
    q_seq = q[token_idx].reshape(seqs, md.max_query_len, kv_heads, q_heads // kv_heads, head_dim)
    q_pos = md.seq_lens[:, None] - q_len[:, None] + offsets[None, :]
    pages = _gather_pages(kv_cache, layer, md.block_tables)
    out = _attend(q_seq, pages, q_pos, q_valid, md.seq_lens, scale, sliding_window, soft_cap)

    # Back to the flattened token order; padding tokens read row 0 and are ignored downstream.
    seq_of_token, index_in_seq = _token_owners(md, num_tokens)
    return out[seq_of_token, index_in_seq].reshape(num_tokens, q_heads, head_dim).astype(q.dtype)


def _per_token(q, kv_cache, layer, md: AttentionMetadata, scale, sliding_window, soft_cap, chunk: int):
    """Each token against its own request's pages, `chunk` tokens at a time (`lax.map`); padding tokens (after
    the last request's) attend to nothing and give zeros."""
    num_tokens, q_heads, head_dim = q.shape
    kv_heads = kv_cache.shape[4]
    seq_of_token, index_in_seq = _token_owners(md, num_tokens)
    q_len = md.query_start_loc[1:] - md.query_start_loc[:-1]
    positions = md.seq_lens[seq_of_token] - q_len[seq_of_token] + index_in_seq
    real = jnp.arange(num_tokens, dtype=jnp.int32) < md.query_start_loc[-1]
    tables, seq_lens = jnp.asarray(md.block_tables), jnp.asarray(md.seq_lens)  # indexed by traced request ids

    def one_token(args):
        q_row, seq, position, valid = args
        pages = _gather_pages(kv_cache, layer, tables[seq][None])
        q_row = q_row.reshape(1, 1, kv_heads, q_heads // kv_heads, head_dim)
        out = _attend(q_row, pages, position[None, None], valid[None, None], seq_lens[seq][None], scale,
                      sliding_window, soft_cap)
        return out.reshape(q_heads, head_dim)

    out = jax.lax.map(one_token, (q, seq_of_token, positions, real), batch_size=chunk)
    return out.astype(q.dtype)


def _token_owners(md: AttentionMetadata, num_tokens: int) -> tuple[Int[Array, " tokens"], Int[Array, " tokens"]]:
    """(request, index among its new tokens) of each flattened token, clipped into range for padding tokens."""
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seqs = md.seq_lens.shape[0]
    seq_of_token = jnp.clip(jnp.searchsorted(md.query_start_loc[1:], token, side="right"), 0, seqs - 1)
    index_in_seq = jnp.clip(token - md.query_start_loc[seq_of_token], 0, md.max_query_len - 1)
    return seq_of_token.astype(jnp.int32), index_in_seq


def _attend(
    q: Float[Array, "rows queries kv_heads group head_dim"],
    pages: Float[Array, "rows context 2 kv_heads head_dim"],
    q_pos: Int[Array, "rows queries"],
    q_valid: Array,
    seq_lens: Int[Array, " rows"],
    scale: float,
    sliding_window,
    soft_cap: float | None,
) -> Float[Array, "rows queries q_heads head_dim"]:
    """Softmax attention of each row's queries over its pages: causal at `q_pos`, within `seq_lens`, the sliding
    window and soft cap applied; an invalid query (or one that sees nothing) gives zeros."""
    rows, queries, kv_heads, group, head_dim = q.shape
    k, v = pages[:, :, 0], pages[:, :, 1]
    scores = jnp.einsum("bqhgd,bshd->bhgqs", q, k, preferred_element_type=jnp.float32, precision="highest")
    scores = scores * scale
    if soft_cap:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    k_pos = jnp.arange(pages.shape[1], dtype=jnp.int32)
    visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])
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
    return out.reshape(rows, queries, kv_heads * group, head_dim)


def _gather_pages(kv_cache: KVCache, layer, block_tables) -> Float[Array, "seqs context 2 kv_heads head_dim"]:
    """Each request's pages of `layer` in position order; a float8 cache dequantized to float32."""
    quantized = isinstance(kv_cache, QuantizedKV)
    kv = kv_cache.kv if quantized else kv_cache
    _, _, block_size, _, kv_heads, head_dim = kv.shape
    seqs, width = block_tables.shape
    pages = kv[layer, block_tables].reshape(seqs, width * block_size, 2, kv_heads, head_dim)  # one gather
    if quantized:
        return pages.astype(jnp.float32) * kv_cache.scales[layer][None, None, :, :, None]
    return pages
