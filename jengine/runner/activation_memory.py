"""The step's activation peak at the configured token budget: what the KV planner keeps free beside the weights.

One pure function of (model spec, scheduler config), no jax, so a planner that only reads config.json can reuse it.
It bounds the largest step the scheduler can build: `max(max_num_batched_tokens, max_num_seqs)` tokens (the largest
token bucket, `runner/buckets.py`), `max_num_seqs` sampling rows and, when a prefill asks for prompt logprobs, a
logits row per token. Every element is counted at 4 bytes (float32): norms and softmaxes upcast, and a bfloat16
model gets the margin. Tensor parallelism splits some of these buffers; the bound is per device and ignores that.

A mixture-of-experts layer sorts its (token, expert) pairs by expert and pads each expert's rows to the grouped
matmul's tile (`MOE_BLOCK_ROWS`), so its buffers grow with tokens × k, not tokens: at 4,096 tokens a Qwen3-30B-A3B
layer holds 32,768 pairs, 16 times the rows of its dense activations.
"""

from __future__ import annotations

import dataclasses

from jengine.config import SchedulerConfig
from jengine.models.spec import ModelSpec

ELEMENT_BYTES = 4  # every activation counted as float32
# The largest row tile of the grouped matmuls: the Mosaic GPU kernels' 128 (`grouped_matmul.mosaic.MosaicTiles`, on
# Hopper for prefill-sized steps) over the Triton kernels' 64 (`grouped_matmul.tile_configs`)
MOE_BLOCK_ROWS = 128
SAMPLER_COPIES = 6  # [rows, vocab] float32 buffers in sampling: logits, penalty counts, scaled, sorted, probs, noise
PROMPT_LOGIT_COPIES = 2  # prompt-logprob rows: their logits and log-softmax
RUNTIME_SLACK_BYTES = 256 << 20  # the runtime's own scratch, compiled programs' constants
# The attention's working set, whatever the step's shape: the reference path (any platform without a kernel, and
# models the kernels refuse) attends in chunks of at most `attention.reference.WORKING_SET_BYTES` (256 MiB),
# which XLA's copies of a chunk's operands can double.
ATTENTION_BYTES = 512 << 20


@dataclasses.dataclass(frozen=True)
class StepActivations:
    """The peak of the largest step, in bytes, by part (each part a bound over every layer)."""

    tokens: int  # flattened tokens of the largest step
    sampling_rows: int  # logits rows the sampler sees
    prompt_rows: int  # logits rows of prompt logprobs, at most
    dense_bytes: int  # one layer's residual stream, attention projections and dense MLP
    moe_bytes: int  # one MoE layer's router, sorted/padded (token, expert) buffers and combine (0 without experts)
    logits_bytes: int  # float32 logits of the sampling and prompt rows, with the sampler's working copies
    attention_bytes: int = ATTENTION_BYTES
    slack_bytes: int = RUNTIME_SLACK_BYTES

    @property
    def total(self) -> int:
        return self.dense_bytes + self.moe_bytes + self.logits_bytes + self.attention_bytes + self.slack_bytes


def step_activations(spec: ModelSpec, sched: SchedulerConfig, block_rows: int = MOE_BLOCK_ROWS) -> StepActivations:
    """The activation peak of `spec`'s largest step under `sched` (see the module docstring for what is counted)."""
    tokens = max(sched.max_num_batched_tokens, sched.max_num_seqs)
    prompt_rows = max(16, tokens)  # the prompt-logprob rows' bucket (runner._prompt_logprob_rows)
    logits = ELEMENT_BYTES * spec.vocab_size * (sched.max_num_seqs * SAMPLER_COPIES + prompt_rows * PROMPT_LOGIT_COPIES)
    return StepActivations(
        tokens=tokens, sampling_rows=sched.max_num_seqs, prompt_rows=prompt_rows,
        dense_bytes=ELEMENT_BYTES * tokens * _dense_elements_per_token(spec),
        moe_bytes=ELEMENT_BYTES * _moe_elements(spec, tokens, block_rows), logits_bytes=logits,
    )


def _dense_elements_per_token(spec: ModelSpec) -> int:
    """Residual in and out, its norm, q/k/v, the attention output and its projection; gate/up, their product and the
    down projection where a layer has a dense MLP."""
    d = spec.hidden_size
    attention = 4 * d + (2 * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    dense_mlp = 3 * spec.intermediate_size + d if "dense" in spec.mlp_kinds else 0
    return attention + dense_mlp


def _moe_elements(spec: ModelSpec, tokens: int, block_rows: int) -> int:
    """Router logits and probabilities per token; per sorted row (the pairs plus up to `block_rows` padding rows per
    expert): the gathered input, gate and up, their product, the output; the outputs back in token order; the
    weighted combine; a shared expert's gate/up, product, output and gate (Qwen2-MoE) beside them."""
    if spec.moe is None or "moe" not in spec.mlp_kinds:
        return 0
    moe, d = spec.moe, spec.hidden_size
    pairs = tokens * moe.num_experts_per_tok
    rows = pairs + moe.num_experts * block_rows
    router = tokens * 2 * moe.num_experts
    sorted_rows = rows * (d + 3 * moe.intermediate_size + d)
    shared = tokens * (3 * moe.shared_intermediate_size + d + 1) if moe.shared_intermediate_size else 0
    return router + sorted_rows + pairs * d + tokens * d + shared
