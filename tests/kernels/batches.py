"""Random ragged batches in fixed padded buckets (so one compile serves many examples), with a poisoned cache."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Static shapes of a test batch: padded token and request counts, block-table width, cache geometry."""

    num_tokens: int = 64
    num_seqs: int = 6
    width: int = 10
    block_size: int = 16
    layers: int = 2
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    dtype: object = jnp.float32

    @property
    def num_blocks(self) -> int:
        return self.num_seqs * self.width + 3

    @property
    def max_context(self) -> int:
        return self.width * self.block_size


@dataclasses.dataclass(frozen=True)
class Batch:
    q: jnp.ndarray
    kv_kernel: jnp.ndarray  # slots no request owns hold NaN: a kernel that reads them fails loudly
    kv_reference: jnp.ndarray  # the same cache with zeros there (the dense reference reads every page it lists)
    query_start_loc: jnp.ndarray
    seq_lens: jnp.ndarray
    block_tables: jnp.ndarray
    num_real_tokens: int


def build(bucket: Bucket, q_lens: list[int], seq_lens: list[int], *, seed: int = 0, layer: int = 1) -> Batch:
    """Requests with the given new/total token counts, pages drawn at random from the pool; padding tokens' queries
    are NaN, and padding requests have length 0."""
    rng = np.random.default_rng(seed)
    b = bucket
    assert sum(q_lens) <= b.num_tokens and len(q_lens) <= b.num_seqs
    assert all(1 <= q <= s <= b.max_context for q, s in zip(q_lens, seq_lens))
    pool = rng.permutation(np.arange(1, b.num_blocks))
    tables = np.zeros((b.num_seqs, b.width), np.int32)
    owned = np.zeros((b.num_blocks, b.block_size), bool)
    used = 0
    for i, s in enumerate(seq_lens):
        n = -(-s // b.block_size)
        tables[i, :n] = pool[used:used + n]
        used += n
        for p in range(s):
            owned[tables[i, p // b.block_size], p % b.block_size] = True
    shape = (b.layers, b.num_blocks, b.block_size, 2, b.kv_heads, b.head_dim)
    values = rng.standard_normal(shape).astype(np.float32)
    own = owned[None, :, :, None, None, None]
    n_real = sum(q_lens)
    q = rng.standard_normal((b.num_tokens, b.q_heads, b.head_dim)).astype(np.float32)
    q[n_real:] = np.nan
    qsl = np.concatenate([[0], np.cumsum(q_lens), np.full(b.num_seqs - len(q_lens), n_real)]).astype(np.int32)
    lens = np.array(list(seq_lens) + [0] * (b.num_seqs - len(seq_lens)), np.int32)
    return Batch(
        q=jnp.asarray(q, b.dtype),
        kv_kernel=jnp.asarray(np.where(own, values, np.nan), b.dtype),
        kv_reference=jnp.asarray(np.where(own, values, 0.0), b.dtype),
        query_start_loc=jnp.asarray(qsl),
        seq_lens=jnp.asarray(lens),
        block_tables=jnp.asarray(tables),
        num_real_tokens=n_real,
    )
