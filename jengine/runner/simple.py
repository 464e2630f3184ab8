"""A fixed-batch paged generator: prefill every prompt in one ragged step, then one-token decode steps.

It drives the same model forward, paged KV layout and attention backend as the engine, with the simplest possible
bookkeeping (each request owns a fixed run of blocks). `jengine generate` and the model parity tests use it; the
continuous-batching engine replaces it for serving.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jengine.attention.backend import AttentionBackend, ReferenceBackend
from jengine.attention.metadata import AttentionMetadata, build_metadata
from jengine.errors import InvalidRequestError
from jengine.layers.attention import allocate_kv_cache
from jengine.models.spec import ModelSpec
from jengine.runner.step import ModelInputs, StepModel, StepState, forward_step


def _step(model: StepModel, params, kv_cache, token_ids, md: AttentionMetadata, rows):
    """The engine's own jitted forward (no token feed): float32 logits at `rows`, the cache donated."""
    inputs = ModelInputs(token_ids, md, rows, None, None)
    logits, _, state, _ = forward_step(model, params, StepState(kv_cache, None), inputs)
    return logits, state.kv_cache


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated tokens per prompt
    prompt_logits: list[np.ndarray] | None  # [prompt_len, vocab] per prompt, when asked for
    step_logits: list[np.ndarray]  # one [batch, vocab] array per sampled position (first one from the prefill)


class SimpleGenerator:
    """Greedy generation for a fixed batch of token-id prompts."""

    def __init__(
        self, spec: ModelSpec, params: dict, dtype, *, block_size: int = 16, backend: AttentionBackend | None = None
    ) -> None:
        self.spec, self.params, self.dtype = spec, params, dtype
        self.block_size = block_size
        self.model = StepModel(spec, backend or ReferenceBackend())

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, *, stop_token_ids: tuple[int, ...] = (),
        return_prompt_logits: bool = False, shuffle_blocks_seed: int | None = None,
    ) -> GenerationResult:
        """`shuffle_blocks_seed` scatters each request's pages over the pool in a seeded random order."""
        self._validate(prompts, max_new_tokens)
        bs = self.block_size
        blocks_per_seq = -(-max(len(p) + max_new_tokens for p in prompts) // bs)
        num_blocks = len(prompts) * blocks_per_seq
        order = np.arange(num_blocks)
        if shuffle_blocks_seed is not None:
            order = np.random.default_rng(shuffle_blocks_seed).permutation(num_blocks)
        tables = [order[b * blocks_per_seq : (b + 1) * blocks_per_seq].tolist() for b in range(len(prompts))]
        kv_cache = allocate_kv_cache(self.spec, num_blocks, bs, self.dtype)
        num_slots = num_blocks * bs

        lens = [len(p) for p in prompts]
        md = build_metadata(lens, lens, tables, block_size=bs, num_slots=num_slots, blocks_per_seq_padded=blocks_per_seq)
        tokens = np.concatenate([np.asarray(p, np.int32) for p in prompts])
        ends = np.cumsum(lens) - 1
        rows = np.arange(len(tokens)) if return_prompt_logits else ends
        logits, kv_cache = _step(self.model, self.params, kv_cache, tokens, md, rows)
        logits = np.asarray(logits)
        prompt_logits = np.split(logits, np.cumsum(lens)[:-1]) if return_prompt_logits else None
        last = logits[ends] if return_prompt_logits else logits

        generated: list[list[int]] = [[] for _ in prompts]
        finished = [False] * len(prompts)
        step_logits = [last]
        for step in range(max_new_tokens):
            next_tokens = np.argmax(last, axis=-1)
            for b, token in enumerate(next_tokens):
                if not finished[b]:
                    generated[b].append(int(token))
                    finished[b] = int(token) in stop_token_ids
            if step == max_new_tokens - 1 or all(finished):
                break
            lens = [n + 1 for n in lens]
            md = build_metadata([1] * len(prompts), lens, tables, block_size=bs, num_slots=num_slots,
                                blocks_per_seq_padded=blocks_per_seq, max_query_len=1)
            rows = np.arange(len(prompts))
            last, kv_cache = _step(self.model, self.params, kv_cache, next_tokens.astype(np.int32), md,
                                   rows)
            last = np.asarray(last)
            step_logits.append(last)
        return GenerationResult(generated, prompt_logits, step_logits)

    def _validate(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InvalidRequestError("every prompt needs at least one token", param="prompt")
        if max_new_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        for p in prompts:
            bad = [t for t in p if not 0 <= t < self.spec.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.spec.vocab_size})",
                                          param="prompt")
