"""GGML block formats → float32, vectorised numpy over whole tensors (no per-block Python loop).

Layouts (ggml's `block_*` structs, little-endian; `d`/`dmin` are float16):
- Q8_0, 32 values in 34 bytes: `d`, then 32 int8 `q`; x = d·q.
- Q4_0, 32 values in 18 bytes: `d`, then 16 bytes whose low nibbles are values 0–15 and high nibbles 16–31;
  x = d·(q − 8).
- Q4_K, 256 values in 144 bytes: `d`, `dmin`, 12 bytes of eight 6-bit scales and eight 6-bit mins (`_k_scales`),
  128 bytes of nibbles. Values come in four chunks of 64: chunk c reads bytes 32c…32c+31, low nibbles are sub-block
  2c, high nibbles sub-block 2c+1; x = d·scale[s]·q − dmin·min[s].
- Q5_K, 256 values in 176 bytes: as Q4_K with 32 bytes `qh` before the nibbles; bit s of qh[l] is the fifth bit of
  value l of sub-block s.
- Q6_K, 256 values in 210 bytes: 128 bytes `ql` (low 4 bits), 64 bytes `qh` (high 2 bits), 16 int8 scales, `d`.
  Two halves of 128 values; in half h, value l + 32j (j = 0…3, l < 32) has low bits from ql[64h + l + 32(j % 2)]
  (low nibble for j < 2, high for j ≥ 2) and high bits (qh[32h + l] >> 2j) & 3; each 16 values share one scale;
  x = d·scale·(q − 32).
Every other type the `gguf` package decodes (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, the IQ formats, ...: what llama.cpp's
quantizer mixes in, e.g. Q5_0 where a Q4_K row is not whole 256-value blocks) is dequantized by `gguf`'s own numpy
decoders (`decoded_by_gguf`).
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
from jaxtyping import Float, UInt8

# ggml type id → (name, values per block, bytes per block)
BLOCKS: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 8: ("Q8_0", 32, 34), 2: ("Q4_0", 32, 18),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2),
}
STORED = ("F32", "F16", "BF16")  # every other type is dequantized (or kept packed) at load


def _f16(blocks: np.ndarray, start: int) -> Float[np.ndarray, "n 1"]:
    """The float16 stored at byte `start` of every block, as a float32 column."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _q8_0(blocks: UInt8[np.ndarray, "n 34"]) -> Float[np.ndarray, "n 32"]:
    return _f16(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)


def _q4_0(blocks: UInt8[np.ndarray, "n 18"]) -> Float[np.ndarray, "n 32"]:
    packed = blocks[:, 2:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.int8) - 8
    return _f16(blocks, 0) * q.astype(np.float32)


def _k_scales(packed: UInt8[np.ndarray, "n 12"]) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit (scale, min) pairs: sub-blocks 0–3 in the low 6 bits of bytes 0–3 (scales) and 4–7
    (mins); sub-blocks 4–7 take their low 4 bits from bytes 8–11 (scale: low nibble, min: high nibble) and their top
    2 bits from the top 2 bits of bytes 0–3 (scales) and 4–7 (mins)."""
    low, high, tail = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 63, (tail & 0x0F) | ((low >> 6) << 4)], axis=1)
    mins = np.concatenate([high & 63, (tail >> 4) | ((high >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_nibbles(qs: UInt8[np.ndarray, "n 128"]) -> UInt8[np.ndarray, "n 8 32"]:
    """The 4-bit values of Q4_K/Q5_K per sub-block: chunk c's low nibbles, then its high nibbles."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(-1, 8, 32)


def _scaled(blocks: np.ndarray, q: np.ndarray) -> Float[np.ndarray, "n 256"]:
    scales, mins = _k_scales(blocks[:, 4:16])
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    return ((d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]).reshape(-1, 256)


def _q4_k(blocks: UInt8[np.ndarray, "n 144"]) -> Float[np.ndarray, "n 256"]:
    return _scaled(blocks, _k_nibbles(blocks[:, 16:]).astype(np.float32))


def _q5_k(blocks: UInt8[np.ndarray, "n 176"]) -> Float[np.ndarray, "n 256"]:
    qh = blocks[:, 16:48]
    fifth = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, sub-block, value]
    q = _k_nibbles(blocks[:, 48:]) | (fifth << 4)
    return _scaled(blocks, q.astype(np.float32))


def _q6_k(blocks: UInt8[np.ndarray, "n 210"]) -> Float[np.ndarray, "n 256"]:
    ql = blocks[:, :128].reshape(-1, 2, 2, 32)  # [n, half, which 32 bytes, l]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [n, half, j, l]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    q = (low | (high << 4)).astype(np.float32) - 32
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 2, 4, 2, 1)
    d = _f16(blocks, 208).reshape(-1, 1, 1, 1, 1)
    return (d * scales * q.reshape(-1, 2, 4, 2, 16)).reshape(-1, 256)


_BLOCK_DEQUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's bytes (any shape whose rows are whole blocks) → `shape`: float32 for the block formats, the stored
    dtype for F32/F16/BF16 (the loader casts it once to the model's dtype)."""
    flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if type_name == "F32":
        return flat.view("<f4").reshape(shape)
    if type_name == "F16":
        return flat.view("<f2").reshape(shape)
    if type_name == "BF16":
        return flat.view(ml_dtypes.bfloat16).reshape(shape)
    if type_name not in _BLOCK_DEQUANT:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

        qtype = GGMLQuantizationType[type_name]
        rows = flat.reshape(-1, GGML_QUANT_SIZES[qtype][1])
        return quants.dequantize(rows, qtype).astype(np.float32, copy=False).reshape(shape)
    _, _, block_bytes = next(block for block in BLOCKS.values() if block[0] == type_name)
    return _BLOCK_DEQUANT[type_name](flat.reshape(-1, block_bytes)).reshape(shape)


@functools.cache
def decoded_by_gguf(qtype) -> bool:
    """Whether the `gguf` package dequantizes `qtype` (a `GGMLQuantizationType`): tried on one zero block, once a
    type (asked for every tensor of a file)."""
    from gguf import GGML_QUANT_SIZES, quants

    try:
        quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except (NotImplementedError, KeyError):
        return False
    return True


def q8_0_parts(raw: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor kept in 8 bits: (int8 values `shape`, float32 scales `shape[:-1] + (shape[-1] / 32,)`)."""
    blocks = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(-1, 34)
    values = blocks[:, 2:].view(np.int8).reshape(shape)
    return values, _f16(blocks, 0).reshape(*shape[:-1], shape[-1] // 32)


INT4_TYPES = ("Q4_0", "Q4_K")  # 4-bit values with a scale and an offset per 32 inputs: the W4A16 kernels' layout
INT4_GROUP = 32


def _blocks(raw: np.ndarray, type_name: str) -> np.ndarray:
    _, _, block_bytes = next(block for block in BLOCKS.values() if block[0] == type_name)
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(-1, block_bytes)


def _k_affine(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's per-sub-block (scale d·sc, offset dmin·m), `[n, 8]` each: x = scale·q − offset."""
    scales, mins = _k_scales(blocks[:, 4:16])
    return _f16(blocks, 0) * scales, _f16(blocks, 2) * mins


def int4_representable(raw: np.ndarray, type_name: str) -> bool:
    """Whether every 32-value group is `(q − z)·s` for a finite zero point z: Q4_0 always; Q4_K unless a sub-block
    has a zero scale and a non-zero offset (a constant no zero point gives)."""
    if type_name == "Q4_0":
        return True
    scale, offset = _k_affine(_blocks(raw, type_name))
    return not np.any((scale == 0) & (offset != 0))


def int4_parts(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0/Q4_K `[rows, K]` tensor as (values 0–15 uint8 `[rows, K]`, zero points and scales float32
    `[rows, K / 32]`) with x = (q − z)·s: Q4_0's z = 8, s = d; Q4_K's s = d·sc, z = dmin·m / s (0 where s is 0 and
    so is the offset; `int4_representable` says whether that covers the tensor)."""
    blocks = _blocks(raw, type_name)
    rows, k = shape
    if type_name == "Q4_0":
        packed = blocks[:, 2:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=1)
        scale = _f16(blocks, 0)
        zero = np.full_like(scale, 8.0)
    else:
        q = _k_nibbles(blocks[:, 16:])
        scale, offset = _k_affine(blocks)
        zero = np.divide(offset, scale, out=np.zeros_like(offset), where=scale != 0)
    return (q.reshape(rows, k), zero.reshape(rows, k // INT4_GROUP).astype(np.float32),
            scale.reshape(rows, k // INT4_GROUP).astype(np.float32))
