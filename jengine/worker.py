"""`jengine serve` on a process other than 0 of a multi-process engine: no API, the same steps as process 0.

The worker builds the same engine (weights, KV pool, runner) on its own devices of the global mesh, then replays
process 0's runner calls (`runner/multi_process.py`) until process 0 stops. The CLI imports this module only in
such a process.
"""

from __future__ import annotations

import logging

import jax

from jengine.config import EngineConfig
from jengine.factory import build_engine
from jengine.parallel.step_feed import StepSubscriber
from jengine.runner.multi_process import replay

logger = logging.getLogger(__name__)


def serve_worker(config: EngineConfig) -> int:
    """Runs process 0's steps until it stops; the exit status (0)."""
    parts = build_engine(config)
    logger.info("worker process %d ready; following process 0", jax.process_index())
    replay(parts.core.runner, StepSubscriber())
    return 0
