"""One engine over several processes (hosts): `jax.distributed` start-up and the KV-pool agreement.

Process 0 runs the scheduler and the servers; every other process runs the same jitted steps on its own devices of
the global mesh, in the same order, with the same inputs: `step_feed.py` carries the steps,
`runner/multi_process.py` publishes and replays them, `jengine/worker.py` is a worker process's entry.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from jengine.config import ParallelConfig
from jengine.errors import ConfigError

logger = logging.getLogger(__name__)

# A worker that dies mid-step fails process 0's step at once (its collective loses the peer), so in-flight requests
# fail and /health turns 503. Beyond that, jax's coordination service ends every process (abort) once a process has
# missed heartbeats this long (jax's default, 100 s, is how long a worker that died while process 0 was idle went
# unnoticed), and a process leaving waits this long for the others at jax's shutdown barrier (jax's default, 300 s,
# is how long process 0 hung on SIGTERM after losing a worker; a live worker gets there within seconds of the stop).
_HEARTBEAT_TIMEOUT_S = 30
_SHUTDOWN_TIMEOUT_S = 15


def initialize(parallel: ParallelConfig) -> None:
    """Joins the processes of one engine (before any device is touched); a no-op for a single process."""
    if parallel.num_processes <= 1 or jax.distributed.is_initialized():
        return
    if not parallel.coordinator_address or parallel.process_id is None:
        raise ConfigError("num_processes > 1 needs coordinator_address and process_id (flags or environment)")
    if not 0 <= parallel.process_id < parallel.num_processes:
        raise ConfigError(f"process_id={parallel.process_id} is outside num_processes={parallel.num_processes}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU meshes across processes (GPUs: NCCL)
    jax.distributed.initialize(coordinator_address=parallel.coordinator_address,
                               num_processes=parallel.num_processes, process_id=parallel.process_id,
                               heartbeat_timeout_seconds=_HEARTBEAT_TIMEOUT_S,
                               shutdown_timeout_seconds=_SHUTDOWN_TIMEOUT_S)
    logger.info("process %d of %d joined %s: %d global devices, %d local", parallel.process_id,
                parallel.num_processes, parallel.coordinator_address, jax.device_count(), jax.local_device_count())


def agree_across_processes(plan):
    """Every process sized the KV pool from its own free memory; all must allocate the same: the smallest."""
    if jax.process_count() == 1:
        return plan
    from jax.experimental import multihost_utils

    blocks = int(multihost_utils.process_allgather(np.array([plan.num_blocks], np.int64)).min())
    return dataclasses.replace(plan, num_blocks=blocks)
