"""Verification of proposed tokens against the target's logits: greedy matching and rejection sampling.

One row per verified position: a request with k drafts has k + 1 rows (draft j is checked at row j, the last row
holds the bonus token), each with its own sampling metadata row (generation step, penalty history including the
drafts before it, min_tokens bans), so top-k / top-p / min-p / penalties / logit bias are those the plain sampler
would apply at that position.

Proposers here are deterministic (the draft distribution q is one-hot at the draft x), so Leviathan et al.'s rule
becomes: accept x with probability p(x); on rejection draw from (p − q)⁺ renormalised, which is p with x removed.
Then P(token = y) = p(x)·[y = x] + (1 − p(x))·p(y)/(1 − p(x))·[y ≠ x] = p(y): the target's distribution exactly.
Greedy rows accept while the draft equals the argmax, so their outputs are the plain engine's.

Randomness comes from each row's own key (seed, choice, generation step), split in two (accept, resample): a row's
tokens never depend on the rest of the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jengine.sampling.metadata import SamplingMetadata
from jengine.sampling.sampler import SamplerOutput, apply_logits_processors, raw_logprobs, row_keys, sampling_logits
from jengine.structured.device import apply_token_mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyOutput:
    candidates: Int[Array, " rows"]  # the token each row emits if verification stops there (rejection or bonus)
    accepted: Bool[Array, " rows"]  # the row's draft is accepted (False on bonus rows)
    logprobs: SamplerOutput | None  # raw logprobs of each row's emitted token, when some row asked for them


@jax.jit
def verify(logits: Float[Array, "rows vocab"], md: SamplingMetadata, draft_ids: Int[Array, " rows"],
           token_mask: Int[Array, "rows words"] | None = None) -> VerifyOutput:
    """Per row: whether its draft (-1: none, a bonus row) is accepted and the token emitted if not. A token mask
    (structured output's rows) bans tokens first, as in the plain sampler."""
    raw = logits.astype(jnp.float32)
    if token_mask is not None:
        raw = apply_token_mask(raw, token_mask)
    processed = apply_logits_processors(raw, md)
    greedy = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    if md.all_greedy:
        candidates, accepted = greedy, draft_ids == greedy
    else:
        candidates, accepted = _rejection_sample(processed, md, draft_ids, greedy)
    if md.max_num_logprobs == 0:
        return VerifyOutput(candidates, accepted, None)
    emitted = jnp.where(accepted, draft_ids, candidates)
    return VerifyOutput(candidates, accepted, raw_logprobs(emitted, raw, md.max_num_logprobs, md.row_reduction))


def _rejection_sample(processed: Float[Array, "rows vocab"], md: SamplingMetadata, draft_ids: Int[Array, " rows"],
                      greedy: Int[Array, " rows"]) -> tuple[Int[Array, " rows"], Bool[Array, " rows"]]:
    scaled = sampling_logits(processed, md)
    vocab = scaled.shape[1]
    keys = row_keys(md)
    accept_keys = jax.vmap(lambda key: jax.random.fold_in(key, 1))(keys)
    resample_keys = jax.vmap(lambda key: jax.random.fold_in(key, 2))(keys)
    uniform = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(accept_keys)
    probs = jax.nn.softmax(scaled, axis=-1)
    has_draft = draft_ids >= 0
    draft_prob = jnp.take_along_axis(probs, jnp.clip(draft_ids, 0, vocab - 1)[:, None], axis=1)[:, 0]
    accepted = has_draft & (uniform < draft_prob)
    residual = jnp.where(jnp.arange(vocab)[None, :] == draft_ids[:, None], -jnp.inf, scaled)
    noise = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(resample_keys)
    recovered = jnp.argmax(residual + noise, axis=-1).astype(jnp.int32)
    is_greedy = md.temperature == 0
    return jnp.where(is_greedy, greedy, recovered), jnp.where(is_greedy, draft_ids == greedy, accepted)

