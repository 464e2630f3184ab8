"""`method: eagle | eagle3`: a one-layer head over the target's own hidden states proposes k tokens greedily.

The head's paged K/V is its own array indexed by the target's block ids (as a draft model's is). Its entry at
position q pairs token q + 1 with the target's feature at q (`eagle_head.py`), so a target step over positions
s .. e − 1 of a request writes the head's entries s − 1 .. e − 2 (`observe`): the pairs inside the step, and the
one straddling the previous step, whose feature the row carries (`carry`: per persistent-batch row, the feature
of its last computed position). Entry e − 1 waits for token e, which the step samples: the first step of the
proposal chain writes it (`propose`), from the row's newest token and carried feature, then each draft step feeds
the head's own output feature and the draft token back (EAGLE's recurrence), writing past the row's blocks into
per-row scratch blocks.

A carry is taken once the step's outcome is known (rejected drafts' features never are): at `propose`, from the
rows' computed counts, or at the next `observe` from where its requests resume. An entry whose feature is not
carried (a prefix-cache hit starts a request at s > 0) is left as the cache holds it: drafts may be worse there,
never the output, which verification decides. The head is greedy, so its proposal distribution is one-hot and the
verifier's rule stays exact. It runs serially (the engine does not pipeline steps for it): every token the head
reads is on the host when the step is dispatched.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from jengine.attention.kv_cache import KVCache
from jengine.attention.metadata import AttentionMetadata
from jengine.runner.input_batch import InputBatch, StepInputs
from jengine.runner.step import ModelInputs
from jengine.spec_decode.chain import chain_block_tables, padded_rows, table_widths
from jengine.spec_decode.eagle_head import HeadModel, commit_carry, observe_step, propose_chain


@dataclasses.dataclass(frozen=True)
class _ObservedStep:
    """A dispatched target step whose features no carry has taken yet."""

    features: Array  # [tokens_padded, d] on the device
    rows: np.ndarray  # persistent-batch row of each scheduled request [seqs]
    owners: np.ndarray  # their admission stamps [seqs]
    starts: np.ndarray  # first position computed [seqs]
    counts: np.ndarray  # positions computed [seqs]
    flat_starts: np.ndarray  # first flattened token [seqs]


class EagleProposer:
    def __init__(self, model: HeadModel, params: dict, kv_cache: KVCache, capture: tuple[int, ...],
                 num_speculative_tokens: int, block_size: int, num_pool_blocks: int, max_model_len: int,
                 max_num_seqs: int) -> None:
        """`kv_cache` holds the pool's blocks and then `chain.scratch_blocks_per_row` × max_num_seqs more;
        `capture`: the target hidden states the head reads (`StepModel.capture`)."""
        self.num_speculative_tokens, self.hidden_capture = num_speculative_tokens, capture
        self.model, self.params, self.kv_cache = model, params, kv_cache
        self.block_size, self.num_pool_blocks = block_size, num_pool_blocks
        self.widths = table_widths(max_model_len, num_speculative_tokens, block_size)
        self.carry = jnp.zeros((max_num_seqs, model.spec.hidden_size), params["embed"].dtype)
        self.carry_position = np.full(max_num_seqs, -1, np.int64)  # position whose feature each row carries
        self.carry_owner = np.zeros(max_num_seqs, np.int64)  # admission stamp of the request it belongs to
        self._observed: _ObservedStep | None = None

    def observe(self, inputs: ModelInputs, step: StepInputs, hidden: Array | None) -> None:
        if self._observed is not None:  # requests of the last step resume right after its last computed position
            self._take_carry(step.rows, step.owners, step.positions_start - 1)
        tokens, source, from_carry, carry_rows, md = self._head_batch(inputs, step)
        self.kv_cache, features = observe_step(self.model, self.params, self.kv_cache, self.carry, hidden, tokens,
                                               source, from_carry, carry_rows, md)
        counts = step.num_scheduled
        self._observed = _ObservedStep(features, step.rows, step.owners, step.positions_start, counts,
                                       np.cumsum(counts) - counts)

    def propose(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        observed = self._observed
        if observed is not None:
            self._take_carry(observed.rows, batch.owners[observed.rows], batch.num_computed[observed.rows] - 1)
            self._observed = None
        k, n = self.num_speculative_tokens, len(rows)
        padded = padded_rows(batch, n)
        start = batch.num_known[rows] - 2  # the entry of the row's newest token (and the feature before it)
        carried = (self.carry_position[rows] == start) & (self.carry_owner[rows] == batch.owners[rows])
        tables = chain_block_tables(batch, rows, start, k, self.widths, self.num_pool_blocks, padded)
        first, carry_rows, positions = (np.zeros(padded, np.int32) for _ in range(3))
        first[:n] = batch.token_ids[rows, start + 1]
        carry_rows[:n] = rows
        positions[:n] = start
        self.kv_cache, drafts = propose_chain(self.model, self.params, self.kv_cache, self.carry, first,
                                              carry_rows, positions, tables, np.int32(n), num_drafts=k,
                                              block_size=self.block_size, num_slots=self._slots())
        drafts = np.asarray(jax.device_get(drafts))[:n].tolist()
        return [d if ok else [] for d, ok in zip(drafts, carried.tolist())]

    # ------------------------------------------------------------------ host bookkeeping
    def _take_carry(self, rows: np.ndarray, owners: np.ndarray, positions: np.ndarray) -> None:
        """Rows of the observed step that computed `positions` (for the same request) carry their features."""
        observed = self._observed
        index = np.full(len(self.carry_position), -1, np.int64)
        index[observed.rows] = np.arange(len(observed.rows))
        i = index[rows]
        found = i >= 0
        i = np.where(found, i, 0)
        offset = positions - observed.starts[i]
        ok = found & (observed.owners[i] == owners) & (offset >= 0) & (offset < observed.counts[i])
        padded = len(observed.features)  # a bucket size: the scatter compiles once per token bucket
        target_rows = np.full(padded, len(self.carry_position), np.int32)
        source = np.zeros(padded, np.int32)
        m = int(ok.sum())
        target_rows[:m] = rows[ok]
        source[:m] = observed.flat_starts[i[ok]] + offset[ok]
        self.carry = commit_carry(self.carry, observed.features, target_rows, source)
        self.carry_position[rows[ok]] = positions[ok]
        self.carry_owner[rows[ok]] = owners[ok]

    def _head_batch(self, inputs: ModelInputs, step: StepInputs) -> tuple[np.ndarray, ...]:
        """The head's ragged batch for a target step: each target token at position p ≥ 1 writes entry p − 1,
        paired with the previous token's feature, or the row's carry for a request's first token (left out when
        the row carries no feature of position p − 1)."""
        md, size = inputs.attention, self.block_size
        counts, starts, rows = step.num_scheduled, step.positions_start, step.rows
        n, total, padded = len(counts), int(counts.sum()), len(inputs.token_ids)
        request = np.repeat(np.arange(n), counts)
        positions = np.asarray(md.positions[:total])
        first = positions == starts[request]
        carried = (self.carry_position[rows] == starts - 1) & (self.carry_owner[rows] == step.owners)
        chosen = np.flatnonzero((positions >= 1) & (~first | carried[request]))
        entry, owner = positions[chosen] - 1, request[chosen]
        kept = np.bincount(owner, minlength=n)
        num_slots = self._slots()
        tables = np.asarray(md.block_tables)

        def pad(values: np.ndarray, fill: int, length: int = padded) -> np.ndarray:
            return np.concatenate([values, np.full(length - len(values), fill)]).astype(np.int32)

        seqs = len(md.seq_lens)
        head_md = AttentionMetadata(
            positions=pad(entry, 0), slot_mapping=pad(tables[owner, entry // size] * size + entry % size, num_slots),
            query_start_loc=pad(np.concatenate([[0], np.cumsum(kept)]), len(chosen), seqs + 1),
            seq_lens=pad(np.where(kept > 0, starts + counts - 1, 0), 0, seqs),
            block_tables=tables, max_query_len=md.max_query_len)
        return (pad(np.asarray(inputs.token_ids)[chosen], 0), pad(chosen - 1, 0), pad(first[chosen], 0).astype(bool),
                pad(rows[owner], 0), head_md)

    def _slots(self) -> int:
        return int(jax.tree_util.tree_leaves(self.kv_cache)[0].shape[1]) * self.block_size
