"""Which arrays the Pallas Triton lowering addresses correctly.

jax 0.11.2's Triton lowering offsets into an array in elements, with 32-bit integers unless the array holds more
than 4 GiB (`_compute_offsets_from_indices` in `jax/_src/pallas/triton/lowering.py`). A 1-byte array (a float8
KV cache) of more than 2^31 elements but at most 4 GiB therefore gets element offsets beyond int32: its upper part
is read, and written, at negative offsets, outside the array. Arrays of 2-byte or wider elements never fall in that
window (4 GiB of them is at most 2^31 elements), and arrays over 4 GiB get 64-bit offsets. The attention kernel
therefore reads a float8 cache through `as_byte_pairs` (uint16 elements); the write kernel still refuses a float8
cache in the window, and jengine writes such a cache with the XLA scatter.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

INT32_ELEMENTS = 2**31  # element offsets must stay below this under 32-bit addressing
WIDE_OFFSETS_ABOVE_BYTES = 2**32  # the lowering switches to 64-bit offsets for arrays larger than this


def next_pow2(n: int) -> int:
    """The smallest power of two holding `n` (at least 1): the Triton lowering takes only power-of-two blocks, so
    ragged extents are padded to it and masked."""
    return 1 << max(n - 1, 0).bit_length()


class UnsupportedShapeError(ValueError):
    """A kernel does not handle this shape; callers fall back to the reference path."""


def offsets_overflow(shape: tuple[int, ...], dtype) -> bool:
    """Whether some element of an array of `shape` and `dtype` lies beyond the lowering's 32-bit offsets."""
    elements = math.prod(shape)
    return elements > INT32_ELEMENTS and elements * jnp.dtype(dtype).itemsize <= WIDE_OFFSETS_ABOVE_BYTES


def check_addressable(shape: tuple[int, ...], dtype) -> None:
    """Raises `UnsupportedShapeError` for an array the kernels would address out of bounds."""
    if offsets_overflow(shape, dtype):
        nbytes = math.prod(shape) * jnp.dtype(dtype).itemsize
        raise UnsupportedShapeError(
            f"a {jnp.dtype(dtype).name} array of {nbytes / 2**30:.2f} GiB per device lies in the window (2 GiB, "
            f"4 GiB] where Pallas' Triton lowering overflows its 32-bit element offsets; size it outside"
        )


def as_byte_pairs(x):
    """A 1-byte array (a float8 cache) seen as uint16 pairs along its last axis: `[..., d] → [..., d // 2]`, byte
    `2j` the low half of element `j`. XLA makes this a bitcast (no copy). The kernels address 1-byte caches through
    this view: 2-byte elements never fall in the 32-bit offset window (module docstring), so a float8 cache of any
    size is addressable."""
    *lead, d = x.shape
    return jax.lax.bitcast_convert_type(x.reshape(*lead, d // 2, 2), jnp.uint16)


def from_byte_pairs(x16, dtype):
    """The inverse of `as_byte_pairs`: `[..., d // 2]` uint16 → `[..., d]` of the 1-byte `dtype`."""
    *lead, half = x16.shape
    return jax.lax.bitcast_convert_type(x16, dtype).reshape(*lead, 2 * half)
