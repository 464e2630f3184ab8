"""Block tables of a proposer's k chained one-token steps, shared by the proposers that keep their own paged KV
over the target's block ids (draft model, EAGLE heads).

A chain writes k positions per row from a start position on; positions inside the row's allocated blocks use
them, positions past them go to the row's scratch blocks, kept after the pool's (nothing outside one proposal
reads them, and the steps that follow rewrite every position the target computes).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from jengine.attention.metadata import AttentionMetadata
from jengine.runner.buckets import pick, powers_of_two
from jengine.runner.input_batch import InputBatch


def scratch_blocks_per_row(num_steps: int, block_size: int) -> int:
    return -(-num_steps // block_size) + 1


def table_widths(max_model_len: int, num_steps: int, block_size: int) -> list[int]:
    return powers_of_two(4, -(-(max_model_len + num_steps) // block_size))


def padded_rows(batch: InputBatch, n: int) -> int:
    """The row bucket of a proposal for `n` rows."""
    return pick(n, powers_of_two(8, max(8, len(batch.num_tokens))))


def chain_block_tables(batch: InputBatch, rows: np.ndarray, first_positions: np.ndarray, num_steps: int,
                       widths: list[int], num_pool_blocks: int, padded: int) -> np.ndarray:
    """[padded, width] block ids covering positions first .. first + num_steps - 1 of each of `rows`."""
    n, size = len(rows), batch.block_size
    width = pick(int((first_positions + num_steps - 1).max()) // size + 1, widths)
    tables = np.zeros((padded, width), np.int32)
    held = np.minimum(batch.num_blocks[rows], width)
    columns = np.arange(width)[None, :]
    per_row = scratch_blocks_per_row(num_steps, size)
    scratch = num_pool_blocks + rows[:, None] * per_row + np.clip(columns - held[:, None], 0, per_row - 1)
    own = np.zeros((n, width), np.int32)
    copied = min(width, batch.block_table.shape[1])
    own[:, :copied] = batch.block_table[rows, :copied]
    tables[:n] = np.where(columns < held[:, None], own, scratch)
    return tables


def one_token_metadata(pos: Int[Array, " n"], block_tables: Int[Array, "n w"], num_valid: Int[Array, ""],
                       block_size: int, num_slots: int) -> AttentionMetadata:
    """Attention metadata of one chain step: one query token per row at `pos`, the first `num_valid` rows real
    (the others write nowhere and attend to nothing)."""
    n = pos.shape[0]
    valid = jnp.arange(n) < num_valid
    blocks = jnp.take_along_axis(block_tables, (pos // block_size)[:, None], axis=1)[:, 0]
    return AttentionMetadata(positions=jnp.where(valid, pos, 0),
                             slot_mapping=jnp.where(valid, blocks * block_size + pos % block_size, num_slots),
                             query_start_loc=jnp.minimum(jnp.arange(n + 1), num_valid).astype(jnp.int32),
                             seq_lens=jnp.where(valid, pos + 1, 0), block_tables=block_tables, max_query_len=1)
