"""4-bit fields of the packed int32 words as float32 without an integer-to-float conversion (a slow instruction):
nibble j (bits 4j … 4j + 3) is moved to mantissa bits 19 … 22 and OR-ed into the bits of 1.0, which reads as
1 + q / 16 exactly. Two integer instructions and no conversion per value; the 1 and the 1/16 are folded into the
zero point and scale by the callers."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

PACK = 8  # 4-bit values per int32 word
ONE_BITS = 0x3F800000  # float32 1.0
FIELD = 0xF << 19  # the top four mantissa bits: a value there reads as q / 16 above 1.0


def nibble_as_float(words, j: int):
    """`1 + q_j / 16` (float32) for nibble j of every word; the shift is a constant, one direction per j."""
    shift = 19 - 4 * j
    moved = words << shift if shift >= 0 else lax.shift_right_logical(words, jnp.int32(-shift))
    return lax.bitcast_convert_type((moved & FIELD) | ONE_BITS, jnp.float32)


def affine(zero, scale):
    """(a, b) with `nibbles_as_float(words) · a + b = (q − z) · s`, that is `(1 + q/16) · 16s − s(16 + z)`: zero
    points and scales `[r, c]` (or `[1, c]`, one group) as `[r, 1, c]`, broadcast over the nibble axis; float32."""
    return (16 * scale)[:, None, :], (-scale * (16 + zero))[:, None, :]


def nibbles_as_float(words):
    """`1 + q / 16` for all 8 nibbles: `[r, c]` words → `[r, 8, c]`, nibble j of word r at `[r, j]` (input row
    8r + j), so merging the first two axes gives the rows in their natural order."""
    shifts = 4 * lax.broadcasted_iota(jnp.int32, (1, PACK, 1), 1)
    fields = lax.shift_right_logical(words[:, None, :], shifts) << 19
    return lax.bitcast_convert_type((fields & FIELD) | ONE_BITS, jnp.float32)
