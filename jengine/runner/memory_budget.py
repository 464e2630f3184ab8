"""How many KV blocks fit one device: vLLM's rule, written once. The engine's planner (`kv_storage.plan_kv_cache`)
feeds it the device's measured memory and the weights it already placed; `jengine plan` feeds it a GPU's size and
the weights estimated from config.json. Plain integers: no jax, no device."""

from __future__ import annotations


def kv_blocks_that_fit(device_bytes: int, utilization: float, weights_bytes: int, reserve_bytes: int,
                       block_bytes: int) -> int:
    """utilization × device memory, minus the weights and the activation reserve, in whole KV blocks of
    `block_bytes` (one device's share of a block); negative when even the weights do not fit."""
    budget = int(device_bytes * utilization) - weights_bytes - reserve_bytes
    return budget // block_bytes
