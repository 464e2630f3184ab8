"""The jitted step: model forward over the ragged batch, logits at the sampling rows, prompt logprobs, the sampler.

The spec and the backend are static (hashable) arguments, so engines built one after another in one process share
compiled steps; the KV cache is donated so XLA updates it in place. One call per engine step, few arguments: the
parameters and the cache are two pytrees.
"""

from __future__ import annotations

import functools

import jax

from jengine.attention.backend import AttentionBackend
from jengine.attention.metadata import AttentionMetadata
from jengine.models.decoder import compute_logits, forward
from jengine.models.spec import ModelSpec
from jengine.sampling.sampler import SamplerOutput, raw_logprobs, sample


@functools.partial(jax.jit, static_argnames=("spec", "backend", "num_prompt_logprobs"), donate_argnames=("kv_cache",))
def forward_step(
    spec: ModelSpec,
    backend: AttentionBackend,
    params: dict,
    kv_cache: jax.Array,
    token_ids: jax.Array,
    md: AttentionMetadata,
    logits_rows: jax.Array,
    prompt_rows: jax.Array | None,
    prompt_targets: jax.Array | None,
    num_prompt_logprobs: int,
) -> tuple[jax.Array, SamplerOutput | None, jax.Array]:
    """Model forward over the ragged batch; float32 logits at the sampling rows; prompt logprobs when asked."""
    hidden, kv_cache = forward(spec, backend, params, kv_cache, token_ids, md)
    logits = compute_logits(spec, params, hidden[logits_rows])
    prompt = None
    if prompt_rows is not None:
        prompt_logits = compute_logits(spec, params, hidden[prompt_rows])
        prompt = raw_logprobs(prompt_targets, prompt_logits, num_prompt_logprobs)
    return logits, prompt, kv_cache


# The sampler is its own jitted call: model shapes and sampling options then compile independently (their counts
# add instead of multiplying), at the price of one more dispatch per step.
sample_step = jax.jit(sample)


def build_step(spec: ModelSpec, backend: AttentionBackend):
    """One engine step for one model: forward, then sampling; positional arguments from `params` on."""

    def step(params, kv_cache, token_ids, md, logits_rows, sampling, prompt_rows, prompt_targets, *,
             num_prompt_logprobs: int):
        logits, prompt, kv_cache = forward_step(spec, backend, params, kv_cache, token_ids, md, logits_rows,
                                                prompt_rows, prompt_targets, num_prompt_logprobs=num_prompt_logprobs)
        return sample_step(logits, sampling), prompt, kv_cache

    return step


def num_compiled_shapes() -> int:
    """How many step variants are compiled in this process (the recompilation guard watches it grow)."""
    return forward_step._cache_size() + sample_step._cache_size()
