"""Rotary position embeddings: inverse frequencies computed once on the host, rotation inside the step.

Frequencies follow HF's float32 computation for each supported `rope_type` so positions map to the same angles.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jengine.models.spec import RopeSpec


def rotary_dim(rope: RopeSpec, head_dim: int) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> tuple[np.ndarray, float]:
    """(inv_freq float32 [rotary_dim // 2], attention scaling of cos/sin) for this rope type."""
    dim = rotary_dim(rope, head_dim)
    inv_freq = (1.0 / (np.float32(rope.theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(
        np.float32
    )
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32), 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)
    return inv_freq, 1.0


def _llama3(rope: RopeSpec, inv_freq: np.ndarray) -> np.ndarray:
    """Llama 3.1: long wavelengths divided by `factor`, a smooth blend between the two cut-offs."""
    factor, low, high = rope.factor, rope.low_freq_factor or 1.0, rope.high_freq_factor or 4.0
    old_len = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def _yarn(rope: RopeSpec, dim: int) -> tuple[np.ndarray, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between; cos/sin scaled by the attention factor."""
    base, factor = rope.theta, rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1
    original = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def apply_rotary(
    x: Float[Array, "tokens heads head_dim"],
    positions: Int[Array, " tokens"],
    inv_freq: Float[Array, " half_rot"],
    attention_scaling: float,
) -> Float[Array, "tokens heads head_dim"]:
    """Rotates the first `2 * len(inv_freq)` features in HF's half-split (`rotate_half`) layout."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = (jnp.cos(emb) * attention_scaling).astype(x.dtype)[:, None, :]
    sin = (jnp.sin(emb) * attention_scaling).astype(x.dtype)[:, None, :]
    rot = emb.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos + rotated * sin
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out
