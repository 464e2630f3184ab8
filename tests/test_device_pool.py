"""JAX's GPU pool sized to `gpu_memory_utilization` of the device (`runner/device_pool.py`), and the KV planner's
budget inside it: utilization means a fraction of the whole device, as in vLLM, whatever size JAX's pool has."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from jengine.config import CacheConfig, SchedulerConfig
from jengine.models.spec import ModelSpec
from jengine.runner.device_pool import POOL_FRACTION_VARIABLES, share_of_pool
from jengine.runner.kv_storage import bytes_per_block, plan_kv_cache

GIB = 1 << 30


@pytest.fixture
def no_pool_fraction(monkeypatch):
    for name in POOL_FRACTION_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("variable", POOL_FRACTION_VARIABLES)
def test_the_share_of_the_pool_is_the_devices_fraction_over_the_pools(no_pool_fraction, variable):
    assert share_of_pool(0.9) == 0.9  # no stated fraction: inside the pool, as JAX sized it
    no_pool_fraction.setenv(variable, "0.9")
    assert share_of_pool(0.9) == 1.0
    assert share_of_pool(0.45) == pytest.approx(0.5)
    no_pool_fraction.setenv(variable, "0.6")
    assert share_of_pool(0.9) == 1.0  # never more than the pool


class PoolDevice:
    """A device whose pool is `fraction` of `total` bytes, with `in_use` of them taken (the weights)."""

    def __init__(self, total: int, fraction: float, in_use: int) -> None:
        self.stats = {"bytes_limit": int(total * fraction), "bytes_in_use": in_use}

    def memory_stats(self) -> dict:
        return self.stats


def _spec() -> ModelSpec:
    from jengine.models.registry import spec_from_hf_config

    return spec_from_hf_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
                                "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                                "rms_norm_eps": 1e-5})


def test_the_planner_gives_the_kv_cache_utilization_of_the_whole_device(no_pool_fraction):
    """An 80 GiB card, 30 GiB of weights, utilization 0.9: the pool sized to 0.9 of the card leaves the KV cache what
    vLLM's rule does (0.9 × 80 − 30 − the reserve), not 0.9 × 0.75 × 80 − 30 − the reserve."""
    spec, sched = _spec(), SchedulerConfig(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=256)
    cache = CacheConfig(gpu_memory_utilization=0.9)
    per_block = bytes_per_block(spec, cache.block_size, jax.numpy.bfloat16)
    no_pool_fraction.setenv(POOL_FRACTION_VARIABLES[0], "0.9")
    sized = plan_kv_cache(spec, cache, sched, jax.numpy.bfloat16, PoolDevice(80 * GIB, 0.9, 30 * GIB))
    reserve_and_rounding = 0.9 * 80 * GIB - 30 * GIB - sized.num_blocks * per_block
    assert 0 < reserve_and_rounding < 2 * GIB
    no_pool_fraction.delenv(POOL_FRACTION_VARIABLES[0])
    default_pool = plan_kv_cache(spec, cache, sched, jax.numpy.bfloat16, PoolDevice(80 * GIB, 0.75, 30 * GIB))
    assert (sized.num_blocks - default_pool.num_blocks) * per_block == pytest.approx(0.9 * 0.25 * 80 * GIB,
                                                                                     rel=1e-3)


SIZE_POOL = """
import json, os, sys
from jengine.runner.device_pool import size_pool
size_pool(float(sys.argv[1]))
if len(sys.argv) > 2:  # start the backends first: too late to size the pool
    import jax; jax.devices()
    os.environ.pop("XLA_CLIENT_MEM_FRACTION", None)
    size_pool(0.5)
print(json.dumps({k: os.environ.get(k) for k in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")}))
"""


def _size_pool_in_fresh_process(env: dict, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SIZE_POOL, *args], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_engine_sizes_the_pool_only_where_nothing_else_did():
    env = {k: v for k, v in os.environ.items() if k not in (*POOL_FRACTION_VARIABLES, "JAX_PLATFORMS")}
    assert _size_pool_in_fresh_process(env, "0.85") == {"XLA_CLIENT_MEM_FRACTION": "0.88",  # with POOL_SLACK
                                                          "XLA_PYTHON_CLIENT_MEM_FRACTION": None}
    assert _size_pool_in_fresh_process(env, "0.99")["XLA_CLIENT_MEM_FRACTION"] == "0.97"  # MAX_POOL
    user = {**env, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6"}  # jaxlib refuses both names at once
    assert _size_pool_in_fresh_process(user, "0.85") == {"XLA_CLIENT_MEM_FRACTION": None,
                                                         "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6"}
    late = _size_pool_in_fresh_process(env, "0.85", "backends first")
    assert late == {"XLA_CLIENT_MEM_FRACTION": None, "XLA_PYTHON_CLIENT_MEM_FRACTION": None}
    cpu_only = _size_pool_in_fresh_process({**env, "JAX_PLATFORMS": "cpu"}, "0.85")
    assert cpu_only == {"XLA_CLIENT_MEM_FRACTION": None, "XLA_PYTHON_CLIENT_MEM_FRACTION": None}
