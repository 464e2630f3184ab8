"""The pure-jnp paged attention (the path of every platform without a kernel, and of models the kernels refuse, such
as float32 ones on a GPU): both of its layouts against a float64 loop over tokens, and its memory at the engine's
largest bucket shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.attention import reference
from jengine.attention.metadata import build_metadata
from jengine.runner.activation_memory import ATTENTION_BYTES

BLOCK, KV_HEADS, GROUP, HEAD_DIM, LAYERS, LAYER = 8, 2, 3, 16, 2, 1


def random_step(rng, query_lens, cached, *, tokens_padded, seqs_padded, width, dtype=jnp.float32):
    """A ragged step over a random cache: each request's blocks drawn without replacement from the pool."""
    seq_lens = [c + q for c, q in zip(cached, query_lens)]
    needed = [-(-n // BLOCK) for n in seq_lens]
    pool = rng.permutation(sum(needed) + 3)
    tables, at = [], 0
    for n in needed:
        tables.append(pool[at:at + n].tolist())
        at += n
    md = build_metadata(query_lens, seq_lens, tables, block_size=BLOCK, num_slots=len(pool) * BLOCK,
                        num_tokens_padded=tokens_padded, num_seqs_padded=seqs_padded, blocks_per_seq_padded=width,
                        max_query_len=max(query_lens))
    kv = rng.standard_normal((LAYERS, len(pool), BLOCK, 2, KV_HEADS, HEAD_DIM))
    q = rng.standard_normal((tokens_padded, KV_HEADS * GROUP, HEAD_DIM))
    return q, kv, md, seq_lens, tables


def float64_attention(q, kv, query_lens, seq_lens, tables, *, scale, window, soft_cap):
    """Token by token, position by position: what each real token should see."""
    out = np.zeros_like(q)
    t = 0
    for b, q_len in enumerate(query_lens):
        for i in range(q_len):
            pos = seq_lens[b] - q_len + i
            seen = [j for j in range(pos + 1) if window <= 0 or j > pos - window]
            k = np.stack([kv[LAYER, tables[b][j // BLOCK], j % BLOCK, 0] for j in seen])  # [n, kv_heads, d]
            v = np.stack([kv[LAYER, tables[b][j // BLOCK], j % BLOCK, 1] for j in seen])
            for h in range(KV_HEADS * GROUP):
                s = k[:, h // GROUP] @ q[t, h] * scale
                if soft_cap:
                    s = soft_cap * np.tanh(s / soft_cap)
                p = np.exp(s - s.max())
                out[t, h] = (p / p.sum()) @ v[:, h // GROUP]
            t += 1
    return out


@pytest.mark.parametrize("tokens_per_chunk", [None, 1, 3], ids=["per_request", "per_token_1", "per_token_3"])
@pytest.mark.parametrize("window,soft_cap", [(0, None), (5, 4.0)])
def test_both_layouts_match_a_float64_loop(tokens_per_chunk, window, soft_cap):
    """None: a budget that never binds (the per-request layout); else the per-token layout with chunks that size."""
    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    query_lens, cached = [3, 1, 6], [9, 20, 0]  # a chunked prefill, a decode, a fresh prompt
    q, kv, md, seq_lens, tables = random_step(rng, query_lens, cached, tokens_padded=12, seqs_padded=4, width=5)
    scale = HEAD_DIM ** -0.5
    context = 5 * BLOCK
    per_token = reference._query_bytes(q, context) + reference._page_bytes(jnp.asarray(kv, jnp.float32), context)
    budget = 1 << 40 if tokens_per_chunk is None else tokens_per_chunk * per_token
    got = jax.jit(lambda q, kv, md: reference.paged_attention(
        q, kv, jnp.int32(LAYER), md, scale=scale, sliding_window=window, soft_cap=soft_cap,
        working_set_bytes=budget))(jnp.asarray(q, jnp.float32), jnp.asarray(kv, jnp.float32), md)
    want = float64_attention(q, kv, query_lens, seq_lens, tables, scale=scale, window=window, soft_cap=soft_cap)
    real = sum(query_lens)
    np.testing.assert_allclose(np.asarray(got[:real], np.float64), want[:real], atol=1e-5, rtol=0)


def test_a_bucket_of_many_requests_and_one_long_prefill_stays_within_the_working_set():
    """The engine warms up its largest buckets, e.g. 8,192 tokens over 256 requests of up to 8,192 new tokens each.
    Padding every request to the longest (256 × 8,192 queries × 1,024 positions × 4 heads of float32 scores:
    32 GiB) put a float32 model on the GPU out of memory at start-up; the per-token layout holds about a chunk."""
    tokens, seqs, width, heads = 8192, 256, 64, 4
    md = build_metadata([1], [1], [[0]], block_size=16, num_slots=16, num_tokens_padded=tokens,
                        num_seqs_padded=seqs, blocks_per_seq_padded=width, max_query_len=tokens)
    md = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), md)
    q = jax.ShapeDtypeStruct((tokens, heads, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 4096, 16, 2, 2, 64), jnp.float32)
    attend = jax.jit(lambda q, kv, md: reference.paged_attention(q, kv, jnp.int32(1), md, scale=0.125))
    temp = attend.lower(q, kv, md).compile().memory_analysis().temp_size_in_bytes  # 64 GiB before
    assert temp <= ATTENTION_BYTES, f"{temp / 2**30:.1f} GiB of temporaries"  # what the KV planner reserves


@pytest.mark.parametrize("budget", [1 << 40, 1], ids=["per_request", "per_token"])
def test_a_float8_cache_is_read_dequantized_in_both_layouts(budget):
    """K and V stored as float8 with per-layer, per-head scales read back as value × scale."""
    from jengine.attention.kv_cache import FP8_DTYPE, QuantizedKV

    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    query_lens, cached = [2, 1, 4], [5, 30, 0]
    q, kv, md, seq_lens, tables = random_step(rng, query_lens, cached, tokens_padded=8, seqs_padded=4, width=5)
    scales = rng.uniform(0.5, 2.0, (LAYERS, 2, KV_HEADS))
    stored = np.asarray(jnp.asarray(kv, jnp.float32).astype(FP8_DTYPE).astype(jnp.float32), np.float64)
    cache = QuantizedKV(jnp.asarray(kv, jnp.float32).astype(FP8_DTYPE), jnp.asarray(scales, jnp.float32))
    scale = HEAD_DIM ** -0.5
    got = reference.paged_attention(jnp.asarray(q, jnp.float32), cache, jnp.int32(LAYER), md, scale=scale,
                                    working_set_bytes=budget)
    dequantized = stored * scales[:, None, None, :, :, None]
    want = float64_attention(q, dequantized, query_lens, seq_lens, tables, scale=scale, window=0, soft_cap=None)
    real = sum(query_lens)
    np.testing.assert_allclose(np.asarray(got[:real], np.float64), want[:real], atol=1e-5, rtol=0)
