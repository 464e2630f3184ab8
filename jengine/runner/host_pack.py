"""One host→device copy for a step's host-built inputs.

A step's inputs are ~25 small numpy arrays (token ids, attention metadata, sampling options). Handed to a jitted
function one by one, each is its own transfer: on H100 machines the 23 of a decode step cost 0.6-1.2 ms of host
time, against 0.05-0.08 ms for the same bytes as one buffer (`scripts/probe_host_dispatch_gpu.py`; host time the
server's other threads get back). `pack` lays the numpy leaves of a pytree end to end in one byte buffer; the
jitted function calls `unpack` and gets the same pytree back, each field a slice of that buffer bit-cast to its
dtype (exact: no value is converted).

The layout (the tree's structure, each field's offset, shape and dtype) is static: it is part of the jit cache key,
as the leaves' shapes were. Leaves that are not numpy (device arrays, Python scalars with their weak types) pass
through unpacked, as their own arguments.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, UInt8

ALIGN = 8  # bytes: every field starts at a multiple of this


class Field(NamedTuple):
    """Where one packed leaf lies in the buffer; `offset` -1: the leaf passes through (index into `passed`). A
    named tuple: a step packs ~25 of them on the host before every launch."""

    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype | None
    passed: int = -1


@dataclasses.dataclass(frozen=True)
class PackLayout:
    treedef: jax.tree_util.PyTreeDef
    fields: tuple[Field, ...]
    nbytes: int


@jax.tree_util.register_pytree_node_class
class Packed:
    """A pytree packed by `pack`: the buffer and the passed-through leaves are its children, the layout its static
    part."""

    __slots__ = ("buffer", "passed", "layout")

    def __init__(self, buffer: Any, passed: tuple, layout: PackLayout):
        self.buffer, self.passed, self.layout = buffer, passed, layout

    def tree_flatten(self) -> tuple[tuple, PackLayout]:
        return (self.buffer, *self.passed), self.layout

    @classmethod
    def tree_unflatten(cls, layout: PackLayout, children: tuple) -> Packed:
        return cls(children[0], tuple(children[1:]), layout)


def _is_host_array(leaf: Any) -> bool:
    return isinstance(leaf, (np.ndarray, np.generic))


@functools.cache
def _device_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype jit gives a host array of `dtype` (64-bit narrowed to 32 with x64 off), looked up once a dtype."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def pack(tree: Any) -> Packed:
    """`tree` with its numpy leaves in one uint8 buffer. 64-bit leaves are narrowed to 32 bits first, as jit
    would narrow them (x64 off)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    fields, chunks, passed, offset = [], [], [], 0
    for leaf in leaves:
        if not _is_host_array(leaf):
            fields.append(Field(-1, (), None, len(passed)))
            passed.append(leaf)
            continue
        array = np.ascontiguousarray(leaf, dtype=_device_dtype(leaf.dtype))
        fields.append(Field(offset, array.shape, array.dtype))
        chunks.append((offset, array))
        offset += -(-array.nbytes // ALIGN) * ALIGN
    buffer = np.zeros(max(offset, ALIGN), np.uint8)
    for start, array in chunks:
        buffer[start:start + array.nbytes] = array.reshape(-1).view(np.uint8)
    return Packed(buffer, tuple(passed), PackLayout(treedef, tuple(fields), offset))


def unpack(packed: Any) -> Any:
    """Inside a jitted function: the tree `pack` was given (anything not `Packed` is returned as it is)."""
    if not isinstance(packed, Packed):
        return packed
    leaves = [packed.passed[f.passed] if f.passed >= 0 else _field(packed.buffer, f) for f in packed.layout.fields]
    return jax.tree_util.tree_unflatten(packed.layout.treedef, leaves)


def _field(buffer: UInt8[Array, " nbytes"], field: Field) -> Array:
    dtype = jnp.dtype(field.dtype)
    size = int(np.prod(field.shape, dtype=np.int64))
    if size == 0:
        return jnp.zeros(field.shape, dtype)
    raw = jax.lax.slice(buffer, (field.offset,), (field.offset + size * dtype.itemsize,))
    if dtype == jnp.bool_:
        return (raw != 0).reshape(field.shape)
    if dtype.itemsize > 1:
        raw = raw.reshape(size, dtype.itemsize)
    return jax.lax.bitcast_convert_type(raw, dtype).reshape(field.shape)
