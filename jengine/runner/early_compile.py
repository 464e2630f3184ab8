"""Compiling the step programs while the weights load.

A warm start waits on three things in a row: the weights reaching the device, the step programs (traced and lowered
on the host, then loaded from the compilation cache) and the warm-up runs. The programs need only the weights'
shapes, dtypes and shardings, which config.json and the checkpoint's headers tell before a byte is read, and the KV
pool's size, which the memory planner tells from those bytes. So the factory starts an abstract runner
(`ModelRunner(..., abstract=True)`) on a thread beside the weight loading, and the real runner built afterwards finds
its programs compiled in JAX's in-process caches: it only runs each once.

A prediction that misses costs the overlap, nothing else: where the loaded weights differ from the expected ones, or
fewer KV blocks fit after loading than were planned, the real runner compiles what it lacks as it always did (and
the log says why). The factory takes this path for its common engine only (see `factory.start_early_compile`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future

import jax
import numpy as np

from jengine.runner.kv_storage import KVPlan

logger = logging.getLogger(__name__)

# The weights take a little more than their arrays' bytes once placed (allocator rounding, the loader's programs);
# the plan made before loading counts this much more, so that the pool it sizes still fits after loading.
SLACK_FRACTION, SLACK_BYTES = 0.01, 64 << 20


def bytes_per_device(params: dict) -> int:
    """What `params` (arrays or ShapeDtypeStructs with shardings) take on each device: its share of every leaf."""
    total = 0
    for leaf in jax.tree.leaves(params):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    return total


def planning_bytes(params: dict) -> int:
    """The bytes per device a plan made before loading counts for the weights (`bytes_per_device` and slack)."""
    size = bytes_per_device(params)
    return size + int(size * SLACK_FRACTION) + SLACK_BYTES


def first_difference(expected: dict, loaded: dict) -> str | None:
    """Where the loaded weights differ from the expected ones in structure, shape, dtype or sharding (None: alike)."""
    flat_expected, tree_expected = jax.tree_util.tree_flatten_with_path(expected)
    flat_loaded, tree_loaded = jax.tree_util.tree_flatten_with_path(loaded)
    if tree_expected != tree_loaded:
        return "the parameter tree"
    for (path, want), (_, got) in zip(flat_expected, flat_loaded):
        if (want.shape, want.dtype, want.sharding) != (got.shape, got.dtype, got.sharding):
            return (f"{jax.tree_util.keystr(path)}: expected {want.shape} {want.dtype} {want.sharding}, loaded "
                    f"{got.shape} {got.dtype} {got.sharding}")
    return None


@dataclasses.dataclass
class EarlyCompile:
    """An abstract runner compiling on a thread: the weights and KV plan it compiles for, and its future."""

    params: dict  # the expected weights, as the step reads them (ShapeDtypeStructs)
    plan: KVPlan  # the KV pool planned before loading
    deterministic: bool  # batch invariance as decided for the expected weights
    future: Future
    started: float

    @classmethod
    def start(cls, pool: Executor, compile_all: Callable[[], object], params: dict, plan: KVPlan,
              deterministic: bool) -> EarlyCompile:
        """Runs `compile_all` (building the abstract runner) on `pool`."""
        return cls(params, plan, deterministic, pool.submit(compile_all), time.perf_counter())

    def settle(self, params: dict, plan_after_loading: KVPlan) -> KVPlan:
        """Waits for the compiles and returns the KV plan the runner takes: the one compiled for, where it fits what
        loading left (it leaves out the planning slack at most), else the plan made after loading (the programs
        are then compiled again, by the runner)."""
        try:
            self.future.result()
        except Exception as error:  # the runner compiles (and reports) for itself
            logger.warning("compiling the step programs while the weights loaded failed (%s: %s); the runner "
                           "compiles them", type(error).__name__, error)
            return plan_after_loading
        done = time.perf_counter() - self.started
        difference = first_difference(self.params, params)
        if difference is not None:
            logger.info("the loaded weights differ from the expected ones (%s): the step programs compiled while "
                        "they loaded (%.1f s) do not serve", difference, done)
            return plan_after_loading
        if self.plan.num_blocks > plan_after_loading.num_blocks:
            logger.info("%d KV blocks fit after loading, fewer than the %d planned before: the step programs "
                        "compiled while the weights loaded (%.1f s) do not serve", plan_after_loading.num_blocks,
                        self.plan.num_blocks, done)
            return plan_after_loading
        logger.info("step programs compiled while the weights loaded (%.1f s after loading began)", done)
        return self.plan
