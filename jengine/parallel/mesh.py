"""The device mesh of one engine replica: a single `tp` axis over the replica's devices.

Axes are `Auto` (GSPMD): the model code stays single-device code, the parameter and KV-cache shardings drive the
partitioning, and XLA inserts the all-reduces. Kernels that are per-device code (Pallas attention, expert-parallel
MoE) run under `jax.shard_map` over the same axis.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jengine.errors import ConfigError

TP_AXIS = "tp"


def replica_devices(tensor_parallel_size: int, data_parallel_size: int = 1, replica: int = 0,
                    devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The devices of data-parallel replica `replica`: a disjoint run of `tensor_parallel_size` devices."""
    devices = list(jax.devices() if devices is None else devices)
    needed = tensor_parallel_size * data_parallel_size
    if needed > len(devices):
        raise ConfigError(
            f"tensor_parallel_size={tensor_parallel_size} × data_parallel_size={data_parallel_size} needs {needed} "
            f"devices, but only {len(devices)} {devices[0].platform if devices else ''} device(s) are present"
        )
    if not 0 <= replica < data_parallel_size:
        raise ConfigError(f"replica {replica} is outside data_parallel_size={data_parallel_size}")
    return devices[replica * tensor_parallel_size : (replica + 1) * tensor_parallel_size]


def build_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A one-axis `tp` mesh over exactly these devices (one device: a trivial mesh, the same code path)."""
    if not devices:
        raise ConfigError("a mesh needs at least one device")
    return Mesh(np.asarray(devices, dtype=object), (TP_AXIS,), axis_types=(AxisType.Auto,))
