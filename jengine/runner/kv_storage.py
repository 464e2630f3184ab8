"""How many KV blocks fit, and the device array that holds them.

The pool size follows vLLM's rule on devices that report memory: `gpu_memory_utilization` × device memory, minus
what the weights already use and an activation reserve for the largest step. Where the device reports no memory (the
CPU) the pool holds `max_num_seqs × max_model_len` tokens, capped at 2 GiB. `num_gpu_blocks_override` is exact. The
weights are counted as placed, so 8-bit weights leave their saving to the pool (less the temporary copies their
matmuls make, reserved beside the activations).
Blocks are counted in the cache's own element type: `kv_cache_dtype="fp8"` stores 1 byte per element, so twice as
many blocks fit as in bfloat16, at any size (the GPU kernels address a float8 cache through a 2-byte view:
`pallas_kernels/addressing.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp

from jengine.attention import kv_cache
from jengine.config import CacheConfig, SchedulerConfig
from jengine.errors import ConfigError
from jengine.layers.attention import kv_cache_shape
from jengine.models.spec import ModelSpec
from jengine.runner.activation_memory import step_activations
from jengine.runner.device_pool import share_of_pool
from jengine.runner.memory_budget import kv_blocks_that_fit

logger = logging.getLogger(__name__)

CPU_POOL_CAP_BYTES = 2 << 30


@dataclasses.dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    source: str  # how the size was chosen, for the start-up line
    kv_dtype: jnp.dtype  # the cache's element type (the model dtype, or float8_e4m3fn for fp8)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def bytes_per_block(spec: ModelSpec, block_size: int, dtype) -> int:
    """One block across all layers, from the layout's single definition (`kv_cache_shape`)."""
    return math.prod(kv_cache_shape(spec, 1, block_size)) * jnp.dtype(dtype).itemsize


def activation_reserve(spec: ModelSpec, sched: SchedulerConfig) -> int:
    """Bytes kept free for the largest step's temporaries (`activation_memory.step_activations`: MoE buffers at
    tokens × k rows, logits rows, runtime slack)."""
    return step_activations(spec, sched).total


def plan_kv_cache(spec: ModelSpec, cache: CacheConfig, sched: SchedulerConfig, dtype, device: jax.Device,
                  kv_shards: int = 1, workspace: int = 0) -> KVPlan:
    """`device` is one of the engine's devices (they are alike); with `kv_shards` devices sharing the KV heads,
    each holds 1/kv_shards of every block, so its memory fits that many more blocks. `workspace`: bytes per device
    the step needs besides the activations (8-bit weights' temporary copies, `layers/quant.py:workspace_bytes`)."""
    kv_dtype = kv_cache.cache_dtype(cache.kv_cache_dtype, dtype)
    per_block = bytes_per_block(spec, cache.block_size, kv_dtype)
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if cache.num_gpu_blocks_override:
        check_override_fits(cache.num_gpu_blocks_override, per_block // kv_shards, stats)
        return KVPlan(cache.num_gpu_blocks_override, cache.block_size, per_block, "num_gpu_blocks_override", kv_dtype)
    if not stats or "bytes_limit" not in stats:
        wanted = -(-sched.max_num_seqs * sched.max_model_len // cache.block_size)
        blocks = min(wanted, CPU_POOL_CAP_BYTES // per_block)
        return KVPlan(max(blocks, 1), cache.block_size, per_block, "max_num_seqs × max_model_len (capped at 2 GiB)",
                      kv_dtype)
    reserve = activation_reserve(spec, sched)
    blocks = kv_blocks_that_fit(stats["bytes_limit"], share_of_pool(cache.gpu_memory_utilization),
                                stats.get("bytes_in_use", 0), reserve + workspace, per_block // kv_shards)
    min_blocks = -(-sched.max_model_len // cache.block_size)
    if blocks < min_blocks:
        raise ConfigError(
            f"not enough device memory for one request of max_model_len={sched.max_model_len}: {max(blocks, 0)} KV "
            f"blocks fit; raise gpu_memory_utilization or lower max_model_len"
        )
    source = (f"gpu_memory_utilization={cache.gpu_memory_utilization}, {reserve / (1 << 30):.2f} GiB kept for the "
              f"activations of a {sched.max_num_batched_tokens}-token step"
              + (f" and {workspace / (1 << 30):.2f} GiB of 8-bit weights' copies" if workspace else ""))
    return KVPlan(int(blocks), cache.block_size, per_block, source, kv_dtype)


def check_override_fits(num_blocks: int, block_bytes: int, stats: dict | None) -> None:
    """Refuses a `num_gpu_blocks_override` whose blocks alone exceed the device's memory left after the weights: it
    would die allocating the pool at start-up with the allocator's message instead. (The activations are not counted
    here: an override is the user's call on them.)"""
    if not stats or "bytes_limit" not in stats:
        return
    fit = kv_blocks_that_fit(stats["bytes_limit"], 1.0, stats.get("bytes_in_use", 0), 0, block_bytes)
    if num_blocks > fit:
        gib = 1 << 30
        raise ConfigError(
            f"num_gpu_blocks_override={num_blocks} needs {num_blocks * block_bytes / gib:.1f} GiB of KV cache, but "
            f"{max(fit, 0) * block_bytes / gib:.1f} GiB ({max(fit, 0)} blocks) of the device's "
            f"{stats['bytes_limit'] / gib:.1f} GiB remain after the weights; lower it"
        )


def log_plan(plan: KVPlan, max_model_len: int) -> None:
    gib = plan.num_blocks * plan.bytes_per_block / (1 << 30)
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB of %s (%s); %d requests of max_model_len=%d fit "
        "at once", plan.num_blocks, plan.block_size, plan.num_tokens, gib, plan.kv_dtype.name, plan.source,
        plan.num_tokens // max_model_len, max_model_len,
    )


def allocate(spec: ModelSpec, plan: KVPlan, sharding: jax.sharding.Sharding | None = None) -> kv_cache.KVCache:
    """The zeroed cache in `plan.kv_dtype`: an array, or a `QuantizedKV` for float8 (its scales set by the first
    step)."""
    shape = kv_cache_shape(spec, plan.num_blocks, plan.block_size)
    return kv_cache.allocate(shape, plan.kv_dtype, sharding)
