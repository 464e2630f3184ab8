"""The KV planner keeps room for the largest step's activations: for a mixture-of-experts model its sorted, padded
(token, expert) buffers grow with the token budget times top-k, and the pool shrinks by what they take."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jengine.config import CacheConfig, SchedulerConfig
from jengine.models.registry import spec_from_hf_config
from jengine.runner.activation_memory import step_activations
from jengine.runner.kv_storage import bytes_per_block, plan_kv_cache

# The Qwen3-30B-A3B layer shape, 48 layers
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
}
SPEC = spec_from_hf_config(QWEN3_30B_A3B)


def hand_reserve(tokens: int, seqs: int) -> int:
    """Written out from the shape: float32 elements, grouped-matmul tiles of up to 128 rows (the Mosaic kernels')."""
    d, experts, k, width, vocab = 2048, 128, 8, 768, 151936
    dense = tokens * (4 * d + (2 * 32 + 2 * 4) * 128)  # residual ×2, norm, o out; q and attention out, k, v
    pairs = tokens * k
    padded_rows = pairs + experts * 128
    moe = tokens * 2 * experts + padded_rows * (d + 3 * width + d) + pairs * d + tokens * d
    logits = vocab * (seqs * 6 + tokens * 2)
    return 4 * (dense + moe + logits) + (512 << 20) + (256 << 20)  # the attention's working set, runtime slack


@pytest.mark.parametrize("tokens", [256, 2048, 4096])
def test_moe_reserve_matches_the_hand_count(tokens):
    sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=tokens)
    assert step_activations(SPEC, sched).total == hand_reserve(max(tokens, 256), 256)


def test_moe_reserve_grows_with_the_token_budget():
    parts = [step_activations(SPEC, SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=t))
             for t in (512, 1024, 2048, 4096, 8192)]
    assert all(a.moe_bytes < b.moe_bytes and a.total < b.total for a, b in zip(parts, parts[1:]))
    # at 4,096 tokens one layer's (token, expert) buffers: 32,768 pairs + 16,384 padding rows × 6,400 elements
    assert parts[3].moe_bytes > 4 * 49152 * 6400
    assert parts[3].moe_bytes > 2**30


def test_dense_model_has_no_expert_buffers():
    dense = {**QWEN3_30B_A3B, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    assert step_activations(spec_from_hf_config(dense), SchedulerConfig()).moe_bytes == 0


class _Gpu:
    def __init__(self, limit: int, in_use: int) -> None:
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats


def test_kv_pool_leaves_the_reserve_free():
    """On a 141 GiB device holding 57 GiB of weights, the pool is what utilisation leaves after weights and the
    hand-counted reserve, and shrinks as the budget grows."""
    limit, weights = 141 << 30, 57 << 30
    cache = CacheConfig()
    per_block = bytes_per_block(SPEC, cache.block_size, jnp.bfloat16)
    blocks = []
    for tokens in (2048, 8192):
        sched = SchedulerConfig(max_num_batched_tokens=tokens, max_model_len=4096)
        plan = plan_kv_cache(SPEC, cache, sched, jnp.bfloat16, _Gpu(limit, weights))
        free = int(limit * cache.gpu_memory_utilization) - weights - hand_reserve(tokens, sched.max_num_seqs)
        assert plan.num_blocks == free // per_block
        blocks.append(plan.num_blocks)
    assert blocks[1] < blocks[0]


def test_an_override_larger_than_the_free_memory_is_refused_by_name():
    """The 8B bench's 64 GiB pool on an 80 GiB card that holds 15 GiB of weights died allocating it at start-up;
    the planner now says so first. An override that fits is taken as given, activations not counted."""
    from jengine.errors import ConfigError

    limit, weights = 79 << 30, 15 << 30
    sched = SchedulerConfig(max_model_len=4096)
    per_block = bytes_per_block(SPEC, 16, jnp.bfloat16)
    fits = (limit - weights) // per_block
    with pytest.raises(ConfigError, match=rf"num_gpu_blocks_override={fits + 1} needs .* \({fits} blocks\)"):
        plan_kv_cache(SPEC, CacheConfig(num_gpu_blocks_override=fits + 1), sched, jnp.bfloat16, _Gpu(limit, weights))
    plan = plan_kv_cache(SPEC, CacheConfig(num_gpu_blocks_override=fits), sched, jnp.bfloat16, _Gpu(limit, weights))
    assert plan.num_blocks == fits and plan.source == "num_gpu_blocks_override"
    # split over 4 devices (kv_shards), each holds a quarter of every block: four times as many fit
    plan_kv_cache(SPEC, CacheConfig(num_gpu_blocks_override=4 * fits), sched, jnp.bfloat16, _Gpu(limit, weights),
                  kv_shards=4)
