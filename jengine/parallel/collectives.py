"""Cross-device sums in an order fixed by the device index (`--deterministic` under tensor parallelism).

An all-reduce adds the devices' partial sums in an order the collective library picks, by message size and
topology (NCCL switches between ring and tree algorithms and chunkings as a step's token count grows), so a row's
result could change with the batch around it. Here each device receives every device's piece of its own slice of
the columns (an all-to-all), adds the pieces left to right in device order, and the sums are gathered back (an
all-gather): the bytes of a ring all-reduce, and a sum that is a function of the row alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def ordered_psum(x: Float[Array, "rows n"], axis: str) -> Float[Array, "rows n"]:
    """The sum of `x` over the devices of mesh axis `axis` (call inside `shard_map`), accumulated in float32 from
    device 0 upward and returned in `x`'s dtype. Columns that do not split evenly over the devices are summed from
    a gather of the whole partials instead (more bytes, the same order)."""
    devices = jax.lax.axis_size(axis)
    rows, n = x.shape
    if n % devices:
        return _in_device_order(jax.lax.all_gather(x, axis), x.dtype)
    # pieces[:, d]: device d's partial of this device's n / devices columns
    pieces = jax.lax.all_to_all(x.reshape(rows, devices, n // devices), axis, split_axis=1, concat_axis=1,
                                tiled=True)
    mine = _in_device_order(jnp.moveaxis(pieces, 1, 0), x.dtype)
    return jax.lax.all_gather(mine, axis, axis=1, tiled=True)


def _in_device_order(stacked: Float[Array, "devices ..."], dtype) -> Float[Array, "..."]:
    total = stacked[0].astype(jnp.float32)
    for device in range(1, stacked.shape[0]):
        total = total + stacked[device].astype(jnp.float32)
    return total.astype(dtype)
