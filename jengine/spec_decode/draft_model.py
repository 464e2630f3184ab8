"""`method: draft_model`: a smaller model with the target's vocabulary proposes k tokens greedily.

Its paged KV cache is its own array but indexed by the target's block ids: the block pool that hands a block to a
request hands it to both models. Every target step is mirrored by a draft forward over the same tokens, positions
and slots (`observe`), so the draft's K/V is current wherever the target's is computed (prefix-cache hits,
chunked prefill and recomputation after preemption included). After the step, `propose` runs k one-token draft
steps per request in one jitted call from the request's last token; positions past its allocated blocks write to
per-row scratch blocks kept after the pool's (nothing outside one call reads them; the next mirror rewrites every
position the target computes).

The draft is greedy, so its proposal distribution is one-hot and the verifier's rejection rule stays exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from jengine.attention.kv_cache import KVCache
from jengine.attention.metadata import AttentionMetadata
from jengine.models.decoder import compute_logits, forward
from jengine.runner.input_batch import InputBatch, StepInputs
from jengine.runner.step import ModelInputs, StepModel
from jengine.spec_decode.chain import (chain_block_tables, one_token_metadata, padded_rows, scratch_blocks_per_row,
                                       table_widths)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("kv",))
def _mirror(model: StepModel, params: dict, kv: KVCache, token_ids: Int[Array, " tokens"],
            attention: AttentionMetadata) -> KVCache:
    """The draft's K/V for a target step's tokens (its hidden states are not needed)."""
    _, kv = forward(model.spec, model.backend, params, kv, token_ids, attention, model.expert_mesh)
    return kv


@functools.partial(jax.jit, static_argnames=("model", "num_drafts", "block_size", "num_slots"),
                   donate_argnames=("kv",))
def _propose(model: StepModel, params: dict, kv: KVCache, first_tokens: Int[Array, " n"],
             positions: Int[Array, " n"], block_tables: Int[Array, "n w"], num_valid: Int[Array, ""],
             num_drafts: int, block_size: int, num_slots: int) -> tuple[KVCache, Int[Array, "n k"]]:
    """`num_drafts` greedy one-token draft steps for each of the first `num_valid` rows."""
    tokens, drafts = first_tokens, []
    for j in range(num_drafts):
        md = one_token_metadata(positions + j, block_tables, num_valid, block_size, num_slots)
        hidden, kv = forward(model.spec, model.backend, params, kv, tokens, md, model.expert_mesh)
        tokens = jnp.argmax(compute_logits(model.spec, params, hidden), axis=-1).astype(jnp.int32)
        drafts.append(tokens)
    return kv, jnp.stack(drafts, axis=1)


class DraftModelProposer:
    hidden_capture = None  # the draft reads tokens only

    def __init__(self, model: StepModel, params: dict, kv_cache: KVCache, num_speculative_tokens: int,
                 block_size: int, num_pool_blocks: int, max_model_len: int) -> None:
        """`kv_cache` holds the pool's blocks and then `scratch_blocks_per_row` × max_num_seqs more."""
        self.num_speculative_tokens = num_speculative_tokens
        self.model, self.params, self.kv_cache = model, params, kv_cache
        self.block_size, self.num_pool_blocks = block_size, num_pool_blocks
        self.widths = table_widths(max_model_len, num_speculative_tokens, block_size)

    @staticmethod
    def scratch_blocks_per_row(num_speculative_tokens: int, block_size: int) -> int:
        return scratch_blocks_per_row(num_speculative_tokens, block_size)

    def observe(self, inputs: ModelInputs, step: StepInputs, hidden: Array | None) -> None:
        self.kv_cache = _mirror(self.model, self.params, self.kv_cache, inputs.token_ids, inputs.attention)

    def propose(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        k, n = self.num_speculative_tokens, len(rows)
        padded = padded_rows(batch, n)
        last = batch.num_known[rows] - 1  # position of each row's last token: the first draft step's input
        tables = chain_block_tables(batch, rows, last, k, self.widths, self.num_pool_blocks, padded)
        first = np.zeros(padded, np.int32)
        first[:n] = batch.token_ids[rows, last]
        positions = np.zeros(padded, np.int32)
        positions[:n] = last
        self.kv_cache, drafts = _propose(self.model, self.params, self.kv_cache, first, positions, tables,
                                         np.int32(n), num_drafts=k, block_size=self.block_size,
                                         num_slots=self._slots())
        return np.asarray(jax.device_get(drafts))[:n].tolist()

    def _slots(self) -> int:
        return int(jax.tree_util.tree_leaves(self.kv_cache)[0].shape[1]) * self.block_size
