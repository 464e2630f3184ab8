"""The jitted step: model forward over the ragged batch, logits at the sampling rows, prompt logprobs, the sampler.

The spec and the backend are static (hashable) arguments, so engines built one after another in one process share
compiled steps; the KV cache is donated so XLA updates it in place. One call per engine step, few arguments: the
parameters and the cache are two pytrees.

The token feed: `row_tokens` holds, per persistent-batch row, the token that row sampled last. The sampler writes it
and the next step's forward reads it wherever the host passed a pending placeholder (`input_batch.pending_token_id`),
so step N+1 can be dispatched before step N's tokens reach the host.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from jengine.attention.backend import AttentionBackend
from jengine.attention.metadata import AttentionMetadata
from jengine.models.decoder import compute_logits, forward
from jengine.models.spec import ModelSpec
from jengine.runner.input_batch import PENDING_BASE
from jengine.sampling.metadata import SamplingMetadata
from jengine.sampling.sampler import SamplerOutput, raw_logprobs, sample


def resolve_pending(ids: Int[Array, "*shape"], row_tokens: Int[Array, " rows"]) -> Int[Array, "*shape"]:
    """`ids` with each pending placeholder (PENDING_BASE - r) replaced by the token row r sampled last."""
    rows = jnp.clip(PENDING_BASE - ids, 0, row_tokens.shape[0] - 1)
    return jnp.where(ids <= PENDING_BASE, row_tokens[rows], ids)


@functools.partial(jax.jit, static_argnames=("spec", "backend", "num_prompt_logprobs", "expert_mesh"),
                   donate_argnames=("kv_cache",))
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
    row_tokens: jax.Array | None = None,
    expert_mesh: jax.sharding.Mesh | None = None,
) -> tuple[jax.Array, SamplerOutput | None, jax.Array]:
    """Model forward over the ragged batch; float32 logits at the sampling rows; prompt logprobs when asked.
    With `row_tokens`, pending placeholders in `token_ids` take the rows' last sampled tokens."""
    if row_tokens is not None:
        token_ids = resolve_pending(token_ids, row_tokens)
    hidden, kv_cache = forward(spec, backend, params, kv_cache, token_ids, md, expert_mesh)
    logits = compute_logits(spec, params, hidden[logits_rows])
    prompt = None
    if prompt_rows is not None:
        prompt_logits = compute_logits(spec, params, hidden[prompt_rows])
        prompt = raw_logprobs(prompt_targets, prompt_logits, num_prompt_logprobs)
    return logits, prompt, kv_cache


# The sampler is its own jitted call: model shapes and sampling options then compile independently (their counts
# add instead of multiplying), at the price of one more dispatch per step. `row_tokens` is not donated: donating a
# buffer that the forward still reads could make the host wait for it, and it is only max_num_seqs ids.
@jax.jit
def sample_step(logits: jax.Array, sampling: SamplingMetadata, row_tokens: Int[Array, " rows"],
                sample_rows: Int[Array, " n"]) -> tuple[SamplerOutput, Int[Array, " rows"]]:
    """Samples one token per row and records it as the last token of its persistent-batch row (`sample_rows`;
    out of range for rows whose sample does not count); pending ids in the penalties' histories are resolved."""
    if sampling.output_token_ids.shape[1]:
        sampling = dataclasses.replace(sampling,
                                       output_token_ids=resolve_pending(sampling.output_token_ids, row_tokens))
    out = sample(logits, sampling)
    return out, row_tokens.at[sample_rows].set(out.token_ids, mode="drop")


def build_step(spec: ModelSpec, backend: AttentionBackend, expert_mesh: jax.sharding.Mesh | None = None):
    """One engine step for one model: forward, then sampling; positional arguments from `params` on. Returns
    (sampler output, prompt logprobs or None, kv_cache, row_tokens); nothing waits for the device."""

    def step(params, kv_cache, row_tokens, token_ids, md, logits_rows, sample_rows, sampling, prompt_rows,
             prompt_targets, *, num_prompt_logprobs: int):
        logits, prompt, kv_cache = forward_step(spec, backend, params, kv_cache, token_ids, md, logits_rows,
                                                prompt_rows, prompt_targets, num_prompt_logprobs=num_prompt_logprobs,
                                                row_tokens=row_tokens, expert_mesh=expert_mesh)
        sampled, row_tokens = sample_step(logits, sampling, row_tokens, sample_rows)
        return sampled, prompt, kv_cache, row_tokens

    return step


def build_step_compiler(spec: ModelSpec, backend: AttentionBackend, expert_mesh: jax.sharding.Mesh | None = None):
    """Compiles the step's two programs for the arguments a step call would get, without running them (nothing is
    donated or written): start-up runs it from several threads, and the step calls that follow reuse the programs.
    Returns the seconds spent (tracing and lowering, XLA compiling or loading from the persistent cache)."""

    def compile_step(params, kv_cache, row_tokens, token_ids, md, logits_rows, sample_rows, sampling, prompt_rows,
                     prompt_targets, *, num_prompt_logprobs: int) -> tuple[float, float]:
        forward, lower_f, compile_f = _lower_and_compile(
            forward_step, spec, backend, params, kv_cache, token_ids, md, logits_rows, prompt_rows, prompt_targets,
            num_prompt_logprobs=num_prompt_logprobs, row_tokens=row_tokens, expert_mesh=expert_mesh)
        logits = forward.out_info[0]
        logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=logits.sharding)
        _, lower_s, compile_s = _lower_and_compile(sample_step, logits, sampling, row_tokens, sample_rows)
        return lower_f + lower_s, compile_f + compile_s

    return compile_step


def _lower_and_compile(jitted, *args, **kwargs):
    """(compiled, seconds tracing and lowering, seconds compiling or loading from the cache)."""
    start = time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    return compiled, lowered_at - start, time.perf_counter() - lowered_at


def num_compiled_shapes() -> int:
    """How many step variants are compiled in this process (the recompilation guard watches it grow)."""
    return forward_step._cache_size() + sample_step._cache_size()
