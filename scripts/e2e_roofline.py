"""Bytes and FLOPs of one Llama decode step, the floor and the roofline they give, and HF's memory need at a batch.

Counted from the HF config alone (no jengine code), so the figures are an independent yardstick for the engine:
- weights read per step: every layer's matrices and norms, the final norm and the LM head, and of the embedding table
  only the rows the step looks up (one per sequence at most);
- KV read: every attended position's K and V in every layer; KV written: the step's new positions;
- FLOPs: 2 per multiply-add of every matrix (layers and LM head) per sequence, plus attention's QKᵀ and PV
  (4 · context · head_dim per query head per layer).
The floor is bytes ÷ the measured copy bandwidth; the roofline is the larger of that and FLOPs ÷ the measured bf16
matrix rate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

BF16_BYTES = 2
HF_RESERVE_BYTES = 6 << 30  # beside HF's weights, cache and activations: CUDA context, allocator slack, logits


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LlamaShape:
        heads = config["num_attention_heads"]
        return cls(config["vocab_size"], config["hidden_size"], config["intermediate_size"],
                   config["num_hidden_layers"], heads, config.get("num_key_value_heads", heads),
                   config.get("head_dim") or config["hidden_size"] // heads,
                   bool(config.get("tie_word_embeddings", False)))

    @property
    def layer_matrix_params(self) -> int:
        """q, k, v, o and the gated MLP's three matrices of one layer."""
        d, hd = self.hidden_size, self.head_dim
        attention = d * self.num_heads * hd * 2 + d * self.num_kv_heads * hd * 2
        return attention + 3 * d * self.intermediate_size

    @property
    def matmul_params(self) -> int:
        """Every matrix a step multiplies by: all layers and the LM head."""
        return self.num_layers * self.layer_matrix_params + self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters, as HF counts them (the tied LM head once)."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_matrix_params + norms + embed * (1 if self.tied_embeddings else 2)

    def kv_bytes_per_token(self, dtype_bytes: int = BF16_BYTES) -> int:
        """K and V of one position in every layer."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes


def weight_bytes_per_step(shape: LlamaShape, batch: int, dtype_bytes: int = BF16_BYTES) -> int:
    """Weights one decode step of `batch` sequences must read: all but the embedding table, plus its looked-up rows
    (a tied table is read whole as the LM head, so its rows add nothing)."""
    norms = (2 * shape.num_layers + 1) * shape.hidden_size
    rows = 0 if shape.tied_embeddings else min(batch, shape.vocab_size) * shape.hidden_size
    return (shape.matmul_params + norms + rows) * dtype_bytes


def decode_step_bytes(shape: LlamaShape, context_lens: Sequence[int], dtype_bytes: int = BF16_BYTES) -> int:
    """Bytes a decode step moves: weights, the K/V of every attended position (the new one included), and the new
    positions' K/V written. `context_lens`: each sequence's length including its new token."""
    per_token = shape.kv_bytes_per_token(dtype_bytes)
    return weight_bytes_per_step(shape, len(context_lens), dtype_bytes) + per_token * (sum(context_lens)
                                                                                      + len(context_lens))


def decode_step_flops(shape: LlamaShape, context_lens: Sequence[int]) -> int:
    """2 FLOPs per multiply-add: the matrices for every sequence, and QKᵀ + PV over each sequence's context."""
    attention = 4 * shape.head_dim * shape.num_heads * shape.num_layers * sum(context_lens)
    return 2 * shape.matmul_params * len(context_lens) + attention


def prefill_flops(shape: LlamaShape, prompt_len: int) -> int:
    """2 FLOPs per multiply-add of one request's prefill: every layer matrix for each prompt token, the LM head for
    the last one only (the one that samples), and causal attention's QKᵀ and PV (token i attends i + 1 positions)."""
    layers = shape.num_layers * shape.layer_matrix_params * prompt_len
    attention = 4 * shape.head_dim * shape.num_heads * shape.num_layers * prompt_len * (prompt_len + 1) // 2
    return 2 * (layers + shape.vocab_size * shape.hidden_size) + attention


def floor_seconds(shape: LlamaShape, context_lens: Sequence[int], copy_bytes_per_s: float) -> float:
    """The step can run no faster than its bytes at the measured copy bandwidth."""
    return decode_step_bytes(shape, context_lens) / copy_bytes_per_s


def roofline_seconds(shape: LlamaShape, context_lens: Sequence[int], copy_bytes_per_s: float,
                     matmul_flops_per_s: float) -> float:
    return max(floor_seconds(shape, context_lens, copy_bytes_per_s),
               decode_step_flops(shape, context_lens) / matmul_flops_per_s)


def hf_bytes_per_sequence(shape: LlamaShape, cache_len: int, prompt_len: int, dtype_bytes: int = BF16_BYTES) -> int:
    """HF `generate`'s device memory per sequence: its KV cache (a static cache holds `cache_len` positions) and the
    eager prefill's activations (the gated MLP's three intermediates and a few hidden-size tensors per token)."""
    activations = prompt_len * (3 * shape.intermediate_size + 6 * shape.hidden_size) * dtype_bytes
    return cache_len * shape.kv_bytes_per_token(dtype_bytes) + activations


def largest_hf_batch(shape: LlamaShape, free_bytes: int, cache_len: int, prompt_len: int, cap: int) -> int:
    """The largest power of two ≤ `cap` whose HF cache and prefill activations fit in `free_bytes` (at least 1)."""
    per_sequence = hf_bytes_per_sequence(shape, cache_len, prompt_len)
    batch = 1
    while batch * 2 <= cap and batch * 2 * per_sequence <= free_bytes:
        batch *= 2
    return batch
