"""The per-step attention metadata: one typed pytree for a flattened, ragged batch.

All scheduled tokens of all requests sit in one 1-D array. Request `b` owns tokens
`query_start_loc[b]:query_start_loc[b + 1]`; after this step it holds `seq_lens[b]` tokens in the cache, the new ones
last, so its new tokens sit at positions `seq_lens[b] - query_len .. seq_lens[b] - 1`. Padding tokens (after
`query_start_loc[-1]`) write to slot `num_slots` (out of range, dropped); padding requests have length 0.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jaxtyping import Array, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    positions: Int[Array, " tokens"]  # absolute position of each token in its sequence
    slot_mapping: Int[Array, " tokens"]  # cache slot = block * block_size + offset; num_slots for padding
    query_start_loc: Int[Array, " seqs_plus_1"]  # prefix sums of the new-token counts
    seq_lens: Int[Array, " seqs"]  # cached + new tokens per request after this step (0 for padding requests)
    block_tables: Int[Array, "seqs blocks_per_seq"]  # physical block ids, position p in block p // block_size
    max_query_len: int = dataclasses.field(metadata=dict(static=True))  # bucketed bound on new tokens per request

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    *,
    block_size: int,
    num_slots: int,
    num_tokens_padded: int | None = None,
    num_seqs_padded: int | None = None,
    blocks_per_seq_padded: int | None = None,
    max_query_len: int | None = None,
) -> AttentionMetadata:
    """Host-side builder (numpy, vectorised) of the metadata for requests with the given new/total token counts."""
    q = np.asarray(query_lens, dtype=np.int32)
    lens = np.asarray(seq_lens, dtype=np.int32)
    num_tokens = int(q.sum())
    tokens_padded = num_tokens_padded or num_tokens
    seqs_padded = num_seqs_padded or len(q)
    width = blocks_per_seq_padded or max((len(t) for t in block_tables), default=1)
    if tokens_padded < num_tokens or seqs_padded < len(q) or width < max((len(t) for t in block_tables), default=0):
        raise ValueError("padded sizes must cover the batch")

    seq_of_token = np.repeat(np.arange(len(q), dtype=np.int32), q)
    start = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    positions = np.arange(num_tokens, dtype=np.int32) - start[seq_of_token] + (lens - q)[seq_of_token]
    tables = np.zeros((seqs_padded, width), dtype=np.int32)
    for b, table in enumerate(block_tables):
        tables[b, : len(table)] = table
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    pad_tokens = tokens_padded - num_tokens
    return AttentionMetadata(
        positions=np.concatenate([positions, np.zeros(pad_tokens, np.int32)]),
        slot_mapping=np.concatenate([slots, np.full(pad_tokens, num_slots, np.int32)]).astype(np.int32),
        query_start_loc=np.concatenate([start, np.full(seqs_padded - len(q), num_tokens, np.int32)]),
        seq_lens=np.concatenate([lens, np.zeros(seqs_padded - len(q), np.int32)]),
        block_tables=tables,
        max_query_len=max_query_len or max(int(q.max(initial=1)), 1),
    )
