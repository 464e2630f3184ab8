"""Projection weights placed in the checkpoint's own layout and transposed on the device.

HF stores a projection as [out, in]; the model multiplies by [in, out]. A transposing copy on the host reads with a
stride and runs at a few GB/s: 5.7 s of an 8B model's 16 GB on a GPU host, most of a warm start's weight time. On an
accelerator each such leaf instead travels as the checkpoint holds it (contiguous rows of the mapped file), in the
wanted sharding with its last two axes swapped, and one small jitted swap turns it into place. Only bytes move, so
the result is the host path's bit for bit.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jengine.models.checkpoint import CheckpointReader
from jengine.models.weights import FusedSource, Source, stacked_block


class DeviceTranspose:
    """Places transposed leaves by a swap on the device; one jitted swap per target sharding, kept for one load."""

    def __init__(self) -> None:
        self._swaps: dict[jax.sharding.Sharding, jax.stages.Wrapped] = {}
        self._lock = threading.Lock()  # the loader's threads share the swaps

    def place(self, reader: CheckpointReader, leaf: Source, dtype: jnp.dtype,
              sharding: jax.sharding.Sharding) -> jax.Array | None:
        """`leaf` on the device in `sharding`, or None where this path does not apply (nothing transposed, repeated
        KV heads, a sharding it cannot mirror): the host path places those."""
        flipped = _swapped_sharding(sharding, len(leaf.shape))
        if flipped is None or not _applies(leaf):
            return None
        raw_shape = leaf.shape[:-2] + (leaf.shape[-1], leaf.shape[-2])
        if isinstance(leaf, FusedSource):  # the parts' rows grouped per shard: a contiguous concatenation
            rows = leaf.fuse([np.asarray(reader.read(str(part.names)), dtype=dtype) for part in leaf.parts], axis=0)
            raw = jax.make_array_from_callback(raw_shape, flipped, lambda index: rows[index])
        else:  # each device's block as the checkpoint holds it, read from the mapped file
            raw = jax.make_array_from_callback(raw_shape, flipped,
                                               lambda index: stacked_block(leaf, index, dtype, reader.read))
        return self._swap(sharding)(raw)

    def _swap(self, sharding: jax.sharding.Sharding) -> jax.stages.Wrapped:
        with self._lock:
            if sharding not in self._swaps:
                self._swaps[sharding] = jax.jit(lambda x: jnp.swapaxes(x, -1, -2), out_shardings=sharding)
            return self._swaps[sharding]


def _applies(leaf: Source) -> bool:
    """Transposed 2-D tensors without repeated heads; a fused leaf's parts single tensors (as `_place_fused`'s)."""
    if isinstance(leaf, FusedSource) and any(p.names.ndim for p in leaf.parts):
        return False
    parts = leaf.parts if isinstance(leaf, FusedSource) else (leaf,)
    return all(p.transpose and p.head_repeat == 1 and len(p.tensor_shape) == 2 for p in parts)


def _swapped_sharding(sharding: jax.sharding.Sharding, ndim: int) -> jax.sharding.Sharding | None:
    """`sharding` of an array whose last two axes are swapped; None where it is not one this can mirror."""
    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    if not isinstance(sharding, NamedSharding) or ndim < 2:
        return None
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:-2], spec[-1], spec[-2]))
