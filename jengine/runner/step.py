"""The jitted step: model forward over the ragged batch, logits at the sampling rows, the sampler, prompt logprobs.

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
from jengine.sampling.metadata import SamplingMetadata
from jengine.sampling.sampler import SamplerOutput, raw_logprobs, sample


@functools.partial(jax.jit, static_argnames=("spec", "backend", "num_prompt_logprobs"), donate_argnames=("kv_cache",))
def model_step(
    spec: ModelSpec,
    backend: AttentionBackend,
    params: dict,
    kv_cache: jax.Array,
    token_ids: jax.Array,
    md: AttentionMetadata,
    logits_rows: jax.Array,
    sampling: SamplingMetadata,
    prompt_rows: jax.Array | None,
    prompt_targets: jax.Array | None,
    num_prompt_logprobs: int,
) -> tuple[SamplerOutput, SamplerOutput | None, jax.Array]:
    hidden, kv_cache = forward(spec, backend, params, kv_cache, token_ids, md)
    sampled = sample(compute_logits(spec, params, hidden[logits_rows]), sampling)
    prompt = None
    if prompt_rows is not None:
        prompt_logits = compute_logits(spec, params, hidden[prompt_rows])
        prompt = raw_logprobs(prompt_targets, prompt_logits, num_prompt_logprobs)
    return sampled, prompt, kv_cache


def build_step(spec: ModelSpec, backend: AttentionBackend):
    """The step for one model: positional arguments from `params` on."""
    return functools.partial(model_step, spec, backend)
