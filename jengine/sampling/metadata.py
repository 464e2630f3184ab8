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
    params = [r.params for r in rows]
    greedy = [p.is_greedy for p in params]

    def column(values: list, dtype: type, fill: float) -> np.ndarray:
        out = np.full(num_rows_padded, fill, dtype=dtype)
        out[: len(values)] = values
        return out

    def sampling_column(name: str, off: float, dtype: type = np.float32) -> np.ndarray:  # greedy rows: filters off
        return column([off if g else getattr(p, name) for p, g in zip(params, greedy)], dtype, off)

    temperature = sampling_column("temperature", 0.0)  # exactly 0 marks a greedy row for the sampler
    top_k = np.minimum(sampling_column("top_k", 0, np.int64), np.iinfo(np.int32).max).astype(np.int32)
    top_p = sampling_column("top_p", 1.0)
    min_p = sampling_column("min_p", 0.0)
    presence = column([p.presence_penalty for p in params], np.float32, 0.0)
    frequency = column([p.frequency_penalty for p in params], np.float32, 0.0)
    repetition = column([p.repetition_penalty for p in params], np.float32, 1.0)
    penalised = (presence != 0) | (frequency != 0) | (repetition != 1)
    use_penalties = bool(penalised.any())

    return SamplingMetadata(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        rng_key=_key_data(rows, num_rows_padded, engine_seed),
        rng_choice=column([r.choice_index for r in rows], np.uint32, 0),
        rng_step=column([r.generation_step for r in rows], np.uint32, 0),
        prompt_token_ids=_pad_rows(
            [r.prompt_token_ids if rep != 1 else () for r, rep in zip(rows, repetition)], num_rows_padded
        ),
        output_token_ids=_pad_rows(
            [r.output_token_ids if pen else () for r, pen in zip(rows, penalised)], num_rows_padded
        ),
        logit_bias_ids=_pad_rows([list((r.params.logit_bias or {}).keys()) for r in rows], num_rows_padded),
        logit_bias_values=_pad_rows(
            [list((r.params.logit_bias or {}).values()) for r in rows], num_rows_padded, fill=0, dtype=np.float32
        ),
        banned_token_ids=_pad_rows([_banned_ids(r) for r in rows], num_rows_padded),
        all_greedy=all(greedy),
        use_penalties=use_penalties,
        use_top_k=bool(np.any(top_k > 0)),
        use_top_p=bool(np.any(top_p < 1)),
        use_min_p=bool(np.any(min_p > 0)),
        max_top_k=_max_top_k(top_k, top_p),
        max_num_logprobs=_logprobs_bucket(params),
    )


def bucket_width(width: int) -> int:
    """0 stays 0 (nothing to pad); otherwise the next power of two, at least _MIN_WIDTH."""
    return 0 if width <= 0 else max(_MIN_WIDTH, 1 << (width - 1).bit_length())


def _pad_rows(
    seqs: Sequence[Sequence[float]], num_rows: int, *, fill: float = -1, dtype: type = np.int32
) -> np.ndarray:
    """Stack ragged rows into [num_rows, bucketed width] in one vectorised scatter (no per-row Python copy)."""
    lengths = np.zeros(num_rows, dtype=np.int64)
    lengths[: len(seqs)] = [len(s) for s in seqs]
    out = np.full((num_rows, bucket_width(int(lengths.max(initial=0)))), fill, dtype=dtype)
    if out.shape[1]:
        flat = np.concatenate([np.asarray(s, dtype=dtype).reshape(-1) for s in seqs])
        out[np.arange(out.shape[1]) < lengths[:, None]] = flat
    return out


def _banned_ids(row: RowInputs) -> list[int]:
    """Stop ids (and EOS unless ignore_eos) are banned while fewer than min_tokens tokens exist, as in vLLM."""
    p = row.params
    if row.generation_step >= p.min_tokens:
        return []
    eos = () if p.ignore_eos else row.eos_token_ids
    return sorted(set(p.stop_token_ids) | set(eos))


def _max_top_k(top_k: np.ndarray, top_p: np.ndarray) -> int:
    """Candidate width for the filters: a small lax.top_k when every top-p row also has a top-k, else 0 (sort all)."""
    needs_all = np.any((top_p < 1) & (top_k == 0))
    largest = int(top_k.max(initial=0))
    if needs_all or largest == 0:
        return 0
    return next((b for b in TOP_K_CANDIDATE_BUCKETS if largest <= b), 0)


def _logprobs_bucket(params: Sequence[SamplingParams]) -> int:
    """K for the top-K raw logprobs; at least 1 when any row asks (logprobs=0 still wants the chosen token's)."""
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return bucket_width(max(1, *asked)) if asked else 0


def _key_data(rows: Sequence[RowInputs], num_rows: int, engine_seed: int) -> np.ndarray:
    """Threefry key data [seed >> 32, seed & 0xffffffff] of each row's 64-bit seed.

    That is PRNGKey(seed)'s key data for 0 ≤ seed < 2³²; negative seeds are taken modulo 2⁶⁴.
    """
    seeds = np.zeros(num_rows, dtype=np.uint64)
    seeds[: len(rows)] = [_row_seed(r, engine_seed) for r in rows]
    return np.stack([seeds >> np.uint64(32), seeds & np.uint64(0xFFFFFFFF)], axis=1).astype(np.uint32)


def _row_seed(row: RowInputs, engine_seed: int) -> int:
    if row.params.seed is not None:
        return row.params.seed & _MASK64
    return _splitmix64(_splitmix64(engine_seed & _MASK64) ^ (row.request_counter & _MASK64))


def _splitmix64(x: int) -> int:
    """A strong 64-bit mixer, so unseeded requests with adjacent counters get unrelated streams."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
