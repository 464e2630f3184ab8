"""The per-step sampling metadata: one typed pytree for a padded batch of rows, built on the host in one place.

Each row is one sequence that samples a token this step. Arrays are data fields; the flags that decide which work the
jitted sampler does at all are static fields, so a batch with no penalties or no top-p never pays for them. Variable
widths (token histories, logit-bias entries, banned ids, top-k candidates, logprobs) are padded to powers of two so a
new batch rarely means a new compilation. Padding rows are greedy with nothing to apply.

Randomness: a row's key is `fold_in(fold_in(PRNGKey(seed), choice_index), generation_step)`, computed inside the jit
from `rng_key` (the threefry key data of `PRNGKey(seed)`), `rng_choice` and `rng_step`. Rows without a seed get a
64-bit seed mixed on the host from the engine seed and the request's counter (splitmix64), then follow the same path,
so a seeded row's tokens depend only on its own seed, choice and step, never on the rest of the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jaxtyping import Array, Float, Int, UInt32

from jengine.layers.invariant import RowReduction
from jengine.sampling.params import SamplingParams

TOP_K_CANDIDATE_BUCKETS = (64, 256, 1024)  # top-k widths served by lax.top_k; wider ones use a full sort
_MIN_WIDTH = 8  # smallest non-empty padded width
_MASK64 = (1 << 64) - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    temperature: Float[Array, " n"]  # 0 exactly for greedy rows (and padding)
    top_k: Int[Array, " n"]  # 0 = off
    top_p: Float[Array, " n"]  # 1 = off
    min_p: Float[Array, " n"]  # 0 = off
    presence_penalty: Float[Array, " n"]
    frequency_penalty: Float[Array, " n"]
    repetition_penalty: Float[Array, " n"]  # 1 = off
    rng_key: UInt32[Array, "n 2"]  # threefry key data of PRNGKey(seed) (seed derived on the host when unseeded)
    rng_choice: UInt32[Array, " n"]  # choice index among the request's n, folded into the key first
    rng_step: UInt32[Array, " n"]  # generation step (index of the output token being sampled), folded in second
    prompt_token_ids: Int[Array, "n max_prompt"]  # -1 padded; width 0 unless some row has a repetition penalty
    output_token_ids: Int[Array, "n max_out"]  # -1 padded; width 0 unless use_penalties
    logit_bias_ids: Int[Array, "n kb"]  # -1 padded; width 0 when no row has a bias
    logit_bias_values: Float[Array, "n kb"]  # 0 where padded
    banned_token_ids: Int[Array, "n kt"]  # stop/EOS ids while min_tokens is not reached; -1 padded
    all_greedy: bool = dataclasses.field(metadata=dict(static=True))  # no row samples: skip all random work
    use_penalties: bool = dataclasses.field(metadata=dict(static=True))  # some row has any of the three penalties
    use_top_k: bool = dataclasses.field(metadata=dict(static=True))  # some sampling row has top_k > 0
    use_top_p: bool = dataclasses.field(metadata=dict(static=True))  # some sampling row has top_p < 1
    use_min_p: bool = dataclasses.field(metadata=dict(static=True))  # some sampling row has min_p > 0
    max_top_k: int = dataclasses.field(metadata=dict(static=True))  # candidates for top-k/top-p; 0 = sort all
    max_num_logprobs: int = dataclasses.field(metadata=dict(static=True))  # top-K raw logprobs to return; 0 = none
    # how the logprobs' log-softmax and top-p's softmax reduce a row: XLA's, or the batch-invariant kernel
    # (`--deterministic`)
    row_reduction: RowReduction = dataclasses.field(default=RowReduction(), metadata=dict(static=True))

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


@dataclasses.dataclass(frozen=True, slots=True)
class RowInputs:
    """What the builder needs to know about one row; the runner fills it from its persistent batch."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]  # the request's prompt (read only for the repetition penalty)
    output_token_ids: Sequence[int]  # tokens this choice has generated so far (penalties)
    generation_step: int  # index of the token being sampled among this choice's outputs (min_tokens, the key)
    choice_index: int = 0  # which of the request's n choices this row is
    request_counter: int = 0  # engine-unique number of the request; seeds its randomness when params.seed is None
    eos_token_ids: tuple[int, ...] = ()  # banned with stop_token_ids until min_tokens (unless ignore_eos)


def build_sampling_metadata(
    rows: Sequence[RowInputs], num_rows_padded: int, *, engine_seed: int = 0
) -> SamplingMetadata:
    """Host-side builder (numpy): the metadata of `rows`, padded to `num_rows_padded` greedy rows."""
    if num_rows_padded < len(rows):
        raise ValueError("num_rows_padded must cover the batch")
    table = SamplingRowTable(max(len(rows), 1), engine_seed=engine_seed)
    for index, row in enumerate(rows):
        table.set_row(index, row.params, row.choice_index, row.request_counter, row.eos_token_ids)
    histories = {i: (r.prompt_token_ids, r.output_token_ids) for i, r in enumerate(rows)}
    steps = np.array([r.generation_step for r in rows], dtype=np.int64)
    return table.build(np.arange(len(rows)), steps, histories.__getitem__, num_rows_padded)


class SamplingRowTable:
    """Per-row sampling settings kept between steps, so a step's metadata is a vectorised gather.

    The runner sets a row when a request enters its persistent batch; per step, only rows with a logit bias, an
    active `min_tokens` ban or a penalty cost any Python work.
    """

    def __init__(self, max_rows: int, *, engine_seed: int = 0, row_reduction: RowReduction = RowReduction()) -> None:
        """`row_reduction`: how the logprobs' log-softmax runs (`layers/invariant.py:RowReduction`)."""
        self.engine_seed = engine_seed
        self.row_reduction = row_reduction
        self.params: list[SamplingParams | None] = [None] * max_rows
        self.eos: list[tuple[int, ...]] = [()] * max_rows
        self.temperature = np.zeros(max_rows, np.float32)  # 0 for greedy rows
        self.top_k = np.zeros(max_rows, np.int32)
        self.top_p = np.ones(max_rows, np.float32)
        self.min_p = np.zeros(max_rows, np.float32)
        self.presence = np.zeros(max_rows, np.float32)
        self.frequency = np.zeros(max_rows, np.float32)
        self.repetition = np.ones(max_rows, np.float32)
        self.key = np.zeros((max_rows, 2), np.uint32)
        self.choice = np.zeros(max_rows, np.uint32)
        self.min_tokens = np.zeros(max_rows, np.int64)
        self.logprobs = np.full(max_rows, -1, np.int64)
        self.has_bias = np.zeros(max_rows, bool)
        self._version = 0  # counts set_row calls: a cached gather is stale once it moves
        self._fixed: tuple | None = None  # (rows, (version, padding), the gather) of the last build

    def set_row(self, row: int, params: SamplingParams, choice_index: int, request_counter: int,
                eos_token_ids: Sequence[int]) -> None:
        greedy = params.is_greedy
        self._version += 1
        self.params[row], self.eos[row] = params, tuple(eos_token_ids)
        self.temperature[row] = 0.0 if greedy else params.temperature
        self.top_k[row] = 0 if greedy else min(params.top_k, np.iinfo(np.int32).max)
        self.top_p[row] = 1.0 if greedy else params.top_p
        self.min_p[row] = 0.0 if greedy else params.min_p
        self.presence[row], self.frequency[row] = params.presence_penalty, params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        seed = row_seed(params.seed, request_counter, self.engine_seed)
        self.key[row] = (seed >> 32, seed & 0xFFFFFFFF)
        self.choice[row] = choice_index
        self.min_tokens[row] = params.min_tokens
        self.logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.has_bias[row] = bool(params.logit_bias)

    def build(self, rows: np.ndarray, generation_steps: np.ndarray, histories, num_rows_padded: int
              ) -> SamplingMetadata:
        """Metadata for `rows` (table indices) sampling their `generation_steps`-th token; `histories(i)` gives
        (prompt ids, output ids) of the i-th row, asked only for penalised rows. `rows` must not be changed later
        (the fields that depend only on it are kept for the next call with the same array)."""
        fixed, penalised = self._fixed_fields(rows, num_rows_padded)
        steps = np.zeros(num_rows_padded, np.uint32)
        steps[: len(rows)] = generation_steps
        return SamplingMetadata(
            **fixed, rng_step=steps,
            **self._histories(penalised, fixed["repetition_penalty"], histories, num_rows_padded),
            banned_token_ids=self._banned(rows, generation_steps, num_rows_padded),
        )

    def _fixed_fields(self, rows: np.ndarray, num_rows_padded: int) -> tuple[dict, np.ndarray]:
        """The fields that depend only on the rows and their settings, and which rows are penalised. Steady decoding
        asks again for the same rows (the same array) step after step, so the last answer is reused until the
        array or a row's settings change: the gathers below are most of the metadata's cost otherwise."""
        key = (self._version, num_rows_padded)
        if self._fixed is None or rows is not self._fixed[0] or key != self._fixed[1]:
            self._fixed = (rows, key, self._gather_fixed(rows, num_rows_padded))
        return self._fixed[2]

    def _gather_fixed(self, rows: np.ndarray, num_rows_padded: int) -> tuple[dict, np.ndarray]:
        n = len(rows)

        def column(values: np.ndarray, fill) -> np.ndarray:
            out = np.full(num_rows_padded, fill, dtype=values.dtype)
            out[:n] = values[rows]
            return out

        temperature, top_k = column(self.temperature, 0), column(self.top_k, 0)
        top_p, min_p = column(self.top_p, 1), column(self.min_p, 0)
        presence, frequency = column(self.presence, 0), column(self.frequency, 0)
        repetition = column(self.repetition, 1)
        penalised = (presence != 0) | (frequency != 0) | (repetition != 1)
        key = np.zeros((num_rows_padded, 2), np.uint32)
        key[:n] = self.key[rows]
        fields = dict(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
            rng_key=key, rng_choice=column(self.choice, 0),
            **self._bias(rows, num_rows_padded),
            all_greedy=not bool(np.any(temperature > 0)),
            use_penalties=bool(penalised.any()),
            use_top_k=bool(np.any(top_k > 0)),
            use_top_p=bool(np.any(top_p < 1)),
            use_min_p=bool(np.any(min_p > 0)),
            max_top_k=_max_top_k(top_k, top_p),
            max_num_logprobs=_logprobs_width(self.logprobs[rows]),
            row_reduction=self.row_reduction,
        )
        return fields, penalised

    def _histories(self, penalised, repetition, histories, num_rows_padded: int) -> dict:
        prompts: dict[int, Sequence[int]] = {}
        outputs: dict[int, Sequence[int]] = {}
        for i in np.flatnonzero(penalised).tolist():
            prompt, output = histories(i)
            if repetition[i] != 1:
                prompts[i] = prompt
            outputs[i] = output
        return dict(prompt_token_ids=_pad_rows(prompts, num_rows_padded),
                    output_token_ids=_pad_rows(outputs, num_rows_padded))

    def _bias(self, rows: np.ndarray, num_rows_padded: int) -> dict:
        ids: dict[int, Sequence[int]] = {}
        values: dict[int, Sequence[float]] = {}
        for i in np.flatnonzero(self.has_bias[rows]).tolist():
            bias = self.params[rows[i]].logit_bias
            ids[i], values[i] = list(bias.keys()), list(bias.values())
        return dict(logit_bias_ids=_pad_rows(ids, num_rows_padded),
                    logit_bias_values=_pad_rows(values, num_rows_padded, fill=0, dtype=np.float32))

    def _banned(self, rows: np.ndarray, generation_steps: np.ndarray, num_rows_padded: int) -> np.ndarray:
        """Stop ids (and EOS unless ignore_eos) are banned while fewer than min_tokens tokens exist, as in vLLM."""
        banned: dict[int, Sequence[int]] = {}
        for i in np.flatnonzero(generation_steps < self.min_tokens[rows]).tolist():
            params = self.params[rows[i]]
            eos = () if params.ignore_eos else self.eos[rows[i]]
            banned[i] = sorted(set(params.stop_token_ids) | set(eos))
        return _pad_rows(banned, num_rows_padded)


def bucket_width(width: int) -> int:
    """0 stays 0 (nothing to pad); otherwise the next power of two, at least _MIN_WIDTH."""
    return 0 if width <= 0 else max(_MIN_WIDTH, 1 << (width - 1).bit_length())


def _pad_rows(
    seqs: dict[int, Sequence[float]], num_rows: int, *, fill: float = -1, dtype: type = np.int32
) -> np.ndarray:
    """Stack ragged rows (row index → values, in increasing row order; rows not given are empty) into
    [num_rows, bucketed width] in one vectorised scatter (no per-row Python copy). Sparse, because most rows of
    most steps have nothing here: then no per-row work at all."""
    lengths = np.zeros(num_rows, dtype=np.int64)
    if seqs:
        lengths[list(seqs)] = [len(s) for s in seqs.values()]
    out = np.full((num_rows, bucket_width(int(lengths.max(initial=0)))), fill, dtype=dtype)
    if out.shape[1]:
        flat = np.concatenate([np.asarray(s, dtype=dtype).reshape(-1) for s in seqs.values()])
        out[np.arange(out.shape[1]) < lengths[:, None]] = flat
    return out


def _max_top_k(top_k: np.ndarray, top_p: np.ndarray) -> int:
    """Candidate width for the filters: a small lax.top_k when every top-p row also has a top-k, else 0 (sort all)."""
    needs_all = np.any((top_p < 1) & (top_k == 0))
    largest = int(top_k.max(initial=0))
    if needs_all or largest == 0:
        return 0
    return next((b for b in TOP_K_CANDIDATE_BUCKETS if largest <= b), 0)


def _logprobs_width(asked: np.ndarray) -> int:
    """K for the top-K raw logprobs; at least 1 when any row asks (logprobs=0 still wants the chosen token's)."""
    asked = asked[asked >= 0]
    return bucket_width(max(1, int(asked.max()))) if asked.size else 0


def row_seed(seed: int | None, request_counter: int, engine_seed: int) -> int:
    """A row's 64-bit seed: its own (modulo 2⁶⁴), else one mixed from the engine seed and the request counter.

    Its threefry key data `[seed >> 32, seed & 0xffffffff]` is PRNGKey(seed)'s for 0 ≤ seed < 2³².
    """
    if seed is not None:
        return seed & _MASK64
    return _splitmix64(_splitmix64(engine_seed & _MASK64) ^ (request_counter & _MASK64))


def _splitmix64(x: int) -> int:
    """A strong 64-bit mixer, so unseeded requests with adjacent counters get unrelated streams."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
