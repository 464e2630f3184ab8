"""The runner's persistent batch: per-request rows of token ids and block tables, updated by the step diffs.

Input preparation is vectorised numpy over the scheduled tokens; per-request facts the step needs (prompt length,
computed tokens, prompt logprobs asked) live in per-row arrays, so a decode step runs no Python loop over requests.

A row's tokens are *known* (their ids are on the host) or *pending*: sampled by a step whose output has not been
fetched yet. A step that needs a pending token gets `pending_token_id(row)` in its place and the jitted step reads
the id from the device array of each row's last sampled token, so the next step never waits for the host.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jengine.attention.metadata import AttentionMetadata
from jengine.runner.buckets import StepBuckets, pick
from jengine.scheduler.output import NewRequestData, SchedulerOutput

PENDING_BASE = -2  # token id PENDING_BASE - r: the token row r sampled last (-1 stays the samplers' padding)


def pending_token_id(rows: np.ndarray | int) -> np.ndarray | int:
    """The placeholder id of the token each row sampled last, for inputs built before that token is on the host."""
    return PENDING_BASE - rows


@dataclasses.dataclass
class RowInfo:
    """Host-side facts about one request the sampler needs."""

    request: NewRequestData
    row: int


@dataclasses.dataclass(frozen=True)
class StepInputs:
    request_ids: list[str]  # scheduled requests, one row each, in step order
    rows: np.ndarray  # persistent-batch row of each scheduled request [seqs]
    token_ids: np.ndarray  # [tokens_padded]
    metadata: AttentionMetadata
    logits_rows: np.ndarray  # last new token of each request [seqs_padded]
    samples: np.ndarray  # bool [seqs]: the step reaches the request's last token, so its sample counts
    positions_start: np.ndarray  # computed tokens before this step [seqs]
    num_scheduled: np.ndarray  # new tokens this step [seqs]
    owners: np.ndarray  # admission stamp of each row [seqs]: a row refilled since then has another one


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, num_slots: int,
                 buckets: StepBuckets, pin_shapes: bool = False) -> None:
        """`pin_shapes` (compile_buckets="all"): the block-table width is the largest bucket (a decode-only step
        whose requests fit the narrower of `buckets.decode_blocks` takes that one), and a prefill step's query bound
        is its token bucket and its request bucket follows from that one, so every step shape is one
        `compile.pinned_shapes` lists."""
        self.block_size, self.num_slots, self.buckets = block_size, num_slots, buckets
        self.pin_shapes = pin_shapes
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_seqs, np.int32)  # known and pending tokens
        self.num_known = np.zeros(max_num_seqs, np.int32)  # leading tokens whose ids are in `token_ids`
        self.owners = np.zeros(max_num_seqs, np.int64)  # stamp of the admission that filled each row
        self._admissions = 0
        self.num_computed = np.zeros(max_num_seqs, np.int32)  # tokens whose K/V the steps so far have written
        self.num_drafts = np.zeros(max_num_seqs, np.int32)  # draft tokens after the known ones, this step only
        self.num_prompt = np.zeros(max_num_seqs, np.int32)
        self.num_prompt_logprobs = np.full(max_num_seqs, -1, np.int32)  # -1: prompt logprobs not asked
        self.lora_slot = np.full(max_num_seqs, -1, np.int32)  # the row's adapter slot; -1: the base model
        self.block_table = np.zeros((max_num_seqs, max(buckets.blocks[-1], max_blocks)), np.int32)
        self.num_blocks = np.zeros(max_num_seqs, np.int32)
        self.rows: dict[str, RowInfo] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._last_ids: list[str] | None = None  # the scheduled requests of the last `rows_of` call ...
        self._last_rows = np.zeros(0, np.int32)  # ... and their rows, valid until a request joins or leaves

    # ------------------------------------------------------------------ diffs
    def apply(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_request_ids | sched.preempted_request_ids:
            self.remove(request_id)
        for request_id, kept in sched.kept_blocks.items():  # blocks freed by a rollback of rejected drafts
            if request_id in self.rows:
                self.num_blocks[self.rows[request_id].row] = kept
        for cached in sched.cached_requests:
            row = self.rows[cached.request_id].row
            self.num_computed[row] = cached.num_computed_tokens
            self._append_blocks(row, cached.new_block_ids)
        for new in sched.new_requests:
            self._add(new)
        self._set_drafts(sched.scheduled_spec_tokens)

    def _set_drafts(self, spec_tokens: dict[str, list[int]]) -> None:
        """Draft tokens sit after a row's known tokens for this step's inputs; they stay unknown (not pending)."""
        self.num_drafts[:] = 0
        for request_id, drafts in spec_tokens.items():
            row = self.rows[request_id].row
            start = self.num_tokens[row]
            self.token_ids[row, start : start + len(drafts)] = drafts
            self.num_drafts[row] = len(drafts)

    def _add(self, new: NewRequestData) -> None:
        row = self._free_rows.pop()
        self.rows[new.request_id] = RowInfo(new, row)
        self._last_ids = None
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = self.num_known[row] = n
        self._admissions += 1
        self.owners[row] = self._admissions
        self.num_computed[row] = new.num_computed_tokens
        self.num_prompt[row] = new.num_prompt_tokens
        wanted = new.sampling_params.prompt_logprobs
        self.num_prompt_logprobs[row] = -1 if wanted is None else wanted
        self.lora_slot[row] = new.lora_slot
        self.num_blocks[row] = 0
        self._append_blocks(row, new.block_ids)

    def remove(self, request_id: str) -> None:
        info = self.rows.pop(request_id, None)
        if info is not None:
            self._free_rows.append(info.row)
            self.owners[info.row] = 0  # steps still in flight for it no longer fill this row
            self._last_ids = None

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def reserve_sampled(self, rows: np.ndarray) -> None:
        """A dispatched step samples one token for each of `rows` (distinct): pending until `fill_sampled`."""
        self.num_tokens[rows] += 1

    def fill_sampled(self, rows: np.ndarray, token_ids: np.ndarray, owners: np.ndarray) -> None:
        """The ids of the oldest pending token of each of `rows`, fetched from the device; rows whose request has
        left (or whose row was refilled) since the step was dispatched are skipped."""
        keep = self.owners[rows] == owners
        if not keep.all():
            rows, token_ids = rows[keep], token_ids[keep]
        self.token_ids[rows, self.num_known[rows]] = token_ids
        self.num_known[rows] += 1

    def fill_verified(self, rows: np.ndarray, owners: np.ndarray, tokens: list[list[int]],
                      num_rejected: np.ndarray) -> None:
        """A verification step's tokens (one to k + 1 per row, one already reserved): rows catch up with them,
        and the K/V of rejected drafts no longer counts as computed."""
        for i in np.flatnonzero(self.owners[rows] == owners).tolist():
            row, emitted = rows[i], tokens[i]
            known = self.num_known[row]
            self.token_ids[row, known : known + len(emitted)] = emitted
            self.num_known[row] = known + len(emitted)
            self.num_tokens[row] += len(emitted) - 1
            self.num_computed[row] -= num_rejected[i]

    def output_history(self, row: int, start: int, end: int) -> np.ndarray:
        """Token ids of positions [start, end) of a row, pending ones as their placeholders (the sampler's
        penalties resolve them on the device)."""
        ids = self.token_ids[row, start:end].copy()
        known = max(int(self.num_known[row]) - start, 0)
        ids[known:] = pending_token_id(row)
        return ids

    def rows_of(self, request_ids: list[str]) -> np.ndarray:
        """The rows of these requests. Steady decoding schedules the same requests in the same order step after
        step, so the last answer is reused then (one list comparison instead of a dict lookup per request)."""
        if request_ids != self._last_ids:
            self._last_ids = request_ids
            self._last_rows = np.array([self.rows[r].row for r in request_ids], np.int32)
        return self._last_rows

    # ------------------------------------------------------------------ one step's inputs
    def _table_width(self, needed: int, longest: int) -> int:
        """The step's block-table width for requests of up to `needed` blocks; `longest`: its most new tokens."""
        if not self.pin_shapes:
            return pick(needed, self.buckets.blocks)
        if longest == 1:  # decode-only: a table narrow enough spares the attention its merge launch
            return pick(needed, self.buckets.decode_blocks)
        return self.buckets.blocks[-1]

    def _query_bound(self, longest: int, tokens_padded: int) -> int:
        if self.pin_shapes:
            return 1 if longest == 1 else tokens_padded
        return pick(longest, self.buckets.query_len)

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """This step's padded inputs; advances the rows' computed counts past the scheduled tokens."""
        request_ids = list(sched.num_scheduled_tokens)
        rows = self.rows_of(request_ids)
        count = np.fromiter(sched.num_scheduled_tokens.values(), np.int32, len(request_ids))
        start = self.num_computed[rows]
        seq_lens = start + count
        self.num_computed[rows] = seq_lens
        total = int(count.sum())
        ends = np.cumsum(count)
        row_of_token = np.repeat(rows, count)
        positions = np.arange(total, dtype=np.int32) - np.repeat(ends - count - start, count)
        blocks = self.block_table[row_of_token, positions // self.block_size]

        b = self.buckets
        longest = int(count.max())
        tokens_padded = pick(total, b.tokens)
        pinned_mixed = self.pin_shapes and longest > 1
        seqs_padded = b.mixed_step_seqs(tokens_padded) if pinned_mixed else pick(len(rows), b.seqs)
        width = self._table_width(int(self.num_blocks[rows].max()), longest)
        pad_tokens, pad_seqs = tokens_padded - total, seqs_padded - len(rows)
        tables = np.zeros((seqs_padded, width), np.int32)
        tables[: len(rows)] = self.block_table[rows, :width]
        md = AttentionMetadata(
            positions=np.concatenate([positions, np.zeros(pad_tokens, np.int32)]),
            slot_mapping=np.concatenate([blocks * self.block_size + positions % self.block_size,
                                         np.full(pad_tokens, self.num_slots, np.int32)]).astype(np.int32),
            query_start_loc=np.concatenate([[0], ends, np.full(pad_seqs, total)]).astype(np.int32),
            seq_lens=np.concatenate([seq_lens, np.zeros(pad_seqs, np.int32)]).astype(np.int32),
            block_tables=tables,
            max_query_len=self._query_bound(longest, tokens_padded),
        )
        token_ids = self.token_ids[row_of_token, positions]
        pending = positions >= (self.num_known + self.num_drafts)[row_of_token]
        if pending.any():  # the previous step's samples, still on the device
            token_ids = np.where(pending, pending_token_id(row_of_token), token_ids)
        token_ids = np.concatenate([token_ids, np.zeros(pad_tokens, np.int32)]).astype(np.int32)
        logits_rows = np.concatenate([ends - 1, np.zeros(pad_seqs, np.int64)]).astype(np.int32)
        samples = seq_lens >= self.num_tokens[rows]
        return StepInputs(request_ids, rows, token_ids, md, logits_rows, samples, start, count, self.owners[rows])
