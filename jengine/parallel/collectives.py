"""Cross-device sums in an order fixed by the device index (`--deterministic` under tensor parallelism).

An all-reduce adds the devices' partial sums in an order the collective library picks, by message size and
topology (NCCL switches between ring and tree algorithms and chunkings as a step's token count grows), so a row's
result could change with the batch around it. Gathering every device's partial and adding them left to right in
device order makes the sum a function of the row alone; it moves the same bytes as the all-gather half of a ring
all-reduce, once per device, a cost worth paying only where invariance is asked for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def ordered_psum(x: Float[Array, "..."], axis: str) -> Float[Array, "..."]:
    """The sum of `x` over the devices of mesh axis `axis` (call inside `shard_map`), accumulated in float32 from
    device 0 upward and returned in `x`'s dtype."""
    gathered = jax.lax.all_gather(x, axis)  # [devices, ...]: an exact copy, no arithmetic
    total = gathered[0].astype(jnp.float32)
    for device in range(1, gathered.shape[0]):
        total = total + gathered[device].astype(jnp.float32)
    return total.astype(x.dtype)
