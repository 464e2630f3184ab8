"""The sampler: logits of a padded batch + SamplingMetadata → one token per row (and raw logprobs), jit-friendly.

vLLM's order: raw logprobs for reporting come from the untouched logits; then logit_bias, min_tokens banning,
repetition penalty, frequency/presence penalties; greedy rows take the argmax there; sampling rows divide by the
temperature, apply top-k, top-p and min-p, and draw with the Gumbel-max trick under a per-row key. Every step is
row-local (no reduction crosses rows), so a row's token does not depend on the rest of the batch. Python branches only
on static fields of the metadata.

Filters are thresholds on the scaled logits, combined into one mask: top-k keeps logits ≥ the k-th largest, top-p
keeps logits ≥ the last one of the smallest prefix (in descending order) whose probability reaches top_p,
min-p keeps logits ≥ max + log(min_p) (the same as prob ≥ min_p × max prob, and unchanged by the renormalisation
after top-k/top-p because the top token always survives). Tokens tied with a threshold are all kept.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jengine.layers.invariant import RowReduction, invariant_log_softmax
from jengine.sampling.metadata import SamplingMetadata

TOP_P_TOLERANCE = 1e-6  # a prefix whose float32 cumulative probability is within this of top_p counts as reaching it
_NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    token_ids: Int[Array, " n"]  # the sampled token of each row
    logprobs: Float[Array, "n k1"] | None  # raw logprobs: column 0 the sampled token, 1..K the top-K; None if K = 0
    logprob_token_ids: Int[Array, "n k1"] | None  # token ids of the columns above
    sampled_rank: Int[Array, " n"] | None  # rank of the sampled token in the raw distribution (1 = most likely)


def sample(logits: Float[Array, "n vocab"], md: SamplingMetadata) -> SamplerOutput:
    """One token per row. Jit it with the metadata as an ordinary argument: its static fields pick the code path."""
    logits = logits.astype(jnp.float32)
    processed = apply_logits_processors(logits, md)
    token_ids = _choose_tokens(processed, md)
    if md.max_num_logprobs == 0:
        return SamplerOutput(token_ids, None, None, None)
    return raw_logprobs(token_ids, logits, md.max_num_logprobs, md.row_reduction)


def apply_logits_processors(logits: Float[Array, "n vocab"], md: SamplingMetadata) -> Float[Array, "n vocab"]:
    """Bias, min_tokens bans and penalties: everything that also changes the greedy choice."""
    logits = _scatter(logits, md.logit_bias_ids, md.logit_bias_values, add=True)
    logits = _scatter(logits, md.banned_token_ids, jnp.full(md.banned_token_ids.shape, _NEG_INF), add=False)
    if md.use_penalties:
        logits = _apply_penalties(logits, md)
    return logits


def _scatter(
    logits: Float[Array, "n vocab"], ids: Int[Array, "n k"], values: Float[Array, "n k"], *, add: bool
) -> Float[Array, "n vocab"]:
    """Per-row scatter of `values` at `ids`; -1 padding is sent out of range and dropped (negative ids would wrap)."""
    if ids.shape[1] == 0:
        return logits
    rows = jnp.arange(logits.shape[0])[:, None]
    at = logits.at[rows, _drop_padding(ids, logits.shape[1])]
    return at.add(values, mode="drop") if add else at.set(values, mode="drop")


def _drop_padding(ids: Int[Array, "n k"], vocab: int) -> Int[Array, "n k"]:
    return jnp.where(ids < 0, vocab, ids)


def _token_counts(ids: Int[Array, "n k"], vocab: int) -> Int[Array, "n vocab"]:
    """How often each token occurs in each row's (padded) history."""
    counts = jnp.zeros((ids.shape[0], vocab), jnp.int32)
    if ids.shape[1] == 0:
        return counts
    rows = jnp.arange(ids.shape[0])[:, None]
    return counts.at[rows, _drop_padding(ids, vocab)].add(1, mode="drop")


def _apply_penalties(logits: Float[Array, "n vocab"], md: SamplingMetadata) -> Float[Array, "n vocab"]:
    """vLLM/OpenAI: repetition over prompt ∪ output (÷ positive, × negative logits), then frequency and presence."""
    vocab = logits.shape[1]
    output_counts = _token_counts(md.output_token_ids, vocab)
    seen = (output_counts > 0) | (_token_counts(md.prompt_token_ids, vocab) > 0)
    rep = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency_penalty[:, None] * output_counts.astype(jnp.float32)
    return logits - md.presence_penalty[:, None] * (output_counts > 0).astype(jnp.float32)


def _choose_tokens(processed: Float[Array, "n vocab"], md: SamplingMetadata) -> Int[Array, " n"]:
    """Argmax for greedy rows; temperature, filters and a Gumbel-max draw for the others."""
    greedy_tokens = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    if md.all_greedy:
        return greedy_tokens
    scaled = sampling_logits(processed, md)
    sampled = jnp.argmax(scaled + _gumbel_noise(md, scaled.shape[1]), axis=-1).astype(jnp.int32)
    return jnp.where(md.temperature == 0, greedy_tokens, sampled)


def sampling_logits(processed: Float[Array, "n vocab"], md: SamplingMetadata) -> Float[Array, "n vocab"]:
    """The logits whose softmax sampling rows draw from: divided by the temperature, filtered tokens at -inf
    (greedy rows are left unscaled). The speculative verifier scores drafts against exactly these."""
    scaled = processed / jnp.where(md.temperature == 0, 1.0, md.temperature)[:, None]
    if md.use_top_k or md.use_top_p or md.use_min_p:
        scaled = jnp.where(scaled < _filter_threshold(scaled, md)[:, None], _NEG_INF, scaled)
    return scaled


def _filter_threshold(scaled: Float[Array, "n vocab"], md: SamplingMetadata) -> Float[Array, " n"]:
    """Per-row lowest logit that survives top-k, top-p and min-p (-inf where a filter is off)."""
    threshold = jnp.full(scaled.shape[0], _NEG_INF)
    if md.use_top_k or md.use_top_p:
        threshold = _top_k_top_p_threshold(scaled, md)
    if md.use_min_p:
        min_p_threshold = jnp.max(scaled, axis=-1) + jnp.log(md.min_p)  # log(0) = -inf: off
        threshold = jnp.maximum(threshold, min_p_threshold)
    return threshold


def _top_k_top_p_threshold(scaled: Float[Array, "n vocab"], md: SamplingMetadata) -> Float[Array, " n"]:
    """Thresholds from the logits in descending order: a cheap lax.top_k of the candidates, or one full sort."""
    vocab = scaled.shape[1]
    if 0 < md.max_top_k < vocab:
        ranked, _ = jax.lax.top_k(scaled, md.max_top_k)
    else:
        ranked = jnp.sort(scaled, axis=-1, descending=True)
    position = jnp.arange(ranked.shape[1])
    threshold = jnp.full(scaled.shape[0], _NEG_INF)
    if md.use_top_k:
        k_on = md.top_k > 0
        k = jnp.clip(md.top_k, 1, ranked.shape[1])
        threshold = jnp.where(k_on, jnp.take_along_axis(ranked, k[:, None] - 1, axis=1)[:, 0], _NEG_INF)
        ranked = jnp.where(k_on[:, None] & (position >= k[:, None]), _NEG_INF, ranked)
    if md.use_top_p:
        threshold = jnp.maximum(threshold, _top_p_threshold(ranked, md.top_p, position, md.row_reduction))
    return threshold


def _top_p_threshold(
    ranked: Float[Array, "n c"], top_p: Float[Array, " n"], position: Int[Array, " c"],
    row_reduction: RowReduction = RowReduction(),
) -> Float[Array, " n"]:
    """The last logit of the smallest descending prefix whose probability reaches top_p (at least the top token).

    Probabilities are those after top-k (renormalised over the ranked candidates, which hold every survivor).
    Under `--deterministic` the softmax is the batch-invariant row kernel's and the prefix sums an
    `associative_scan`, whose tree of adds is fixed by the row's length alone (XLA's cumsum picks its algorithm by
    the whole array's shape).
    """
    if row_reduction.impl == "xla":
        probs = jax.nn.softmax(ranked, axis=-1)
        prefix = jnp.cumsum(probs, axis=-1)
    else:
        probs = jnp.exp(invariant_log_softmax(ranked, row_reduction))
        prefix = jax.lax.associative_scan(jnp.add, probs, axis=-1)
    before = prefix - probs  # probability of the strictly better-ranked tokens
    keep: Bool[Array, "n c"] = (before < (top_p - TOP_P_TOLERANCE)[:, None]) | (position == 0)
    last = jnp.sum(keep, axis=-1) - 1  # keep is a prefix: `before` never decreases
    threshold = jnp.take_along_axis(ranked, last[:, None], axis=1)[:, 0]
    return jnp.where(top_p < 1, threshold, _NEG_INF)


def row_keys(md: SamplingMetadata) -> jax.Array:
    """Typed keys fold_in(fold_in(PRNGKey(seed), choice_index), generation_step), one per row."""
    keys = jax.random.wrap_key_data(md.rng_key, impl="threefry2x32")
    fold = jax.vmap(jax.random.fold_in)
    return fold(fold(keys, md.rng_choice), md.rng_step)


def _gumbel_noise(md: SamplingMetadata, vocab: int) -> Float[Array, "n vocab"]:
    """Per-row Gumbel noise: argmax(logits + noise) samples softmax(logits) exactly; only the row's key matters."""
    return jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(row_keys(md))


def raw_logprobs(token_ids: Int[Array, " n"], logits: Float[Array, "n vocab"], num_logprobs: int,
                 row_reduction: RowReduction = RowReduction()) -> SamplerOutput:
    """Log-softmax of the raw logits: the given tokens' values and ranks, then the top-K (vLLM's default logprobs).

    The sampler reports its chosen tokens with it; the runner reuses it for prompt logprobs (tokens = the next prompt
    token of each position). `num_logprobs` and `row_reduction` (`layers/invariant.py:RowReduction`) are static.
    """
    raw = invariant_log_softmax(logits, row_reduction)
    chosen = jnp.take_along_axis(raw, token_ids[:, None], axis=1)
    top_values, top_ids = jax.lax.top_k(raw, min(num_logprobs, raw.shape[1]))
    rank = jnp.sum(raw > chosen, axis=-1).astype(jnp.int32) + 1
    return SamplerOutput(
        token_ids=token_ids,
        logprobs=jnp.concatenate([chosen, top_values], axis=1),
        logprob_token_ids=jnp.concatenate([token_ids[:, None], top_ids.astype(jnp.int32)], axis=1),
        sampled_rank=rank,
    )


_with_raw_logprobs = raw_logprobs  # the old private name, still imported by runner/step.py; use raw_logprobs
