"""Shared-memory layouts for Mosaic GPU tiles that TMA fills and wgmma reads."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu


def swizzled(dtype, minor: int) -> tuple:
    """The transforms of a tile whose rows hold `minor` elements of `dtype`: 8-row tiles as wide as the widest
    swizzle its rows fill (128 bytes: 64 bfloat16 or 128 float8 values), so wgmma reads it without bank conflicts."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)
