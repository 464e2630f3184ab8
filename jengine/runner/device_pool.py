"""JAX's GPU memory pool, sized for the engine.

JAX's GPU client allocates from a pool of 75 % of the device's memory unless told otherwise (`memory_stats()`'s
`bytes_limit`). `gpu_memory_utilization` means, as in vLLM, a fraction of the whole device (0.92 by default):
planned inside JAX's default pool it would give 0.92 × 0.75 of the device, and a 61 GB model on an 80 GB card would
find no room for its KV cache at all. So before JAX starts its GPU backend the engine sizes the pool to
`gpu_memory_utilization` and a little more (`XLA_CLIENT_MEM_FRACTION`), unless the environment sizes it already; the
planner then takes the part of the pool that is `gpu_memory_utilization` of the device (`share_of_pool`). The little
more, POOL_SLACK of the device, stays in the pool for temporaries the activation estimate misses; what is left
outside holds the CUDA context and libraries' handles. Where JAX's backend was up before the engine (a notebook that
ran JAX first), the pool is what it is, and the engine plans inside it as before.
"""

from __future__ import annotations

import logging
import os

import jax

logger = logging.getLogger(__name__)

# The variables jaxlib reads for the pool's fraction of the device, the current name first (it refuses both at once)
POOL_FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
POOL_SLACK = 0.03  # of the device, in the pool beyond gpu_memory_utilization
MAX_POOL = 0.97  # of the device, at most


def size_pool(utilization: float) -> None:
    """Sizes JAX's GPU pool to `utilization` (and POOL_SLACK) of the device, where nothing sized it, JAX's backends
    are not up and JAX is not held to the CPU."""
    from jax._src.xla_bridge import backends_are_initialized

    if pool_fraction() is not None or (jax.config.jax_platforms or "").split(",") == ["cpu"]:
        return
    fraction = min(utilization + POOL_SLACK, MAX_POOL)
    if backends_are_initialized():
        if jax.default_backend() == "gpu":
            logger.info("JAX's GPU backend started before the engine, in a pool of 75 %% of the device: the engine "
                        "plans gpu_memory_utilization=%g of that pool; set XLA_CLIENT_MEM_FRACTION=%.2f before JAX "
                        "starts for that share of the whole device", utilization, fraction)
        return
    os.environ[POOL_FRACTION_VARIABLES[0]] = f"{fraction:.4g}"


def pool_fraction() -> float | None:
    """The fraction of the device the environment sizes JAX's GPU pool to; None where it says nothing."""
    for name in POOL_FRACTION_VARIABLES:
        if os.environ.get(name):
            return float(os.environ[name])
    return None


def share_of_pool(utilization: float) -> float:
    """The part of JAX's pool (`bytes_limit`) the engine plans with: `utilization` of the device over the pool's
    stated fraction, at most the whole pool; where no fraction is stated (JAX's default, whose limit some versions
    let grow), `utilization` of the pool."""
    fraction = pool_fraction()
    return utilization if fraction is None else min(1.0, utilization / fraction)
