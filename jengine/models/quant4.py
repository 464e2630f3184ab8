"""4-bit (and GPTQ 8-bit) integer checkpoints: AWQ, GPTQ and compressed-tensors `pack-quantized` W4A16, unpacked
on the host, then repacked into the W4A16 kernel's layout (`models/quant4_place.py`, `layers/quant4.py`) or, where
the kernel cannot take them (groups of 64, 8 bits, expert stacks, tensor parallelism), dequantized at load to the
model's dtype (the log says which and why).

The unpackers return `Unpacked` (integer values, zero points, group scales, each input row's group): what a W4A16
kernel consumes, with `perm` the one input-row reordering that makes GPTQ's activation-order groups contiguous.
Layouts, as the producing libraries write them (a module's HF weight is `[out N, in K]`, groups run along K):

- AWQ, AutoAWQ's GEMM format (`version: "gemm"`): `qweight` int32 `[K, N/8]` and `qzeros` int32 `[K/g, N/8]` pack 8
  output columns per word, nibble i (bits 4i…4i+3) holding column `AWQ_ORDER[i]` of its 8; `scales` `[K/g, N]`;
  w = (q − z) · s.
- GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 `[K·bits/32, N]` packs 32/bits input rows per word, row r of the
  word at bits r·bits; `qzeros` int32 `[groups, N·bits/32]` packs output columns the same way; `scales`
  `[groups, N]`; `g_idx` `[K]` each input row's group (out of order with `desc_act`). `checkpoint_format` "gptq"
  (v1) stores each zero point one less than the real one, "gptq_v2" stores it as is; w = (q − z) · s[g_idx].
- compressed-tensors `pack-quantized`, 4 bits: `weight_packed` int32 `[N, K/8]` packs 8 input values per word,
  value i at bits 4i, stored as signed value + 8; `weight_scale` `[N, groups]` (`channel`: one group);
  `weight_zero_point` (asymmetric only) `[N/8, groups]` packed the same way along N; `weight_shape` `[N, K]`;
  optional `weight_g_idx`; w = (q − z) · s.

Refused by name: AWQ's other kernels' formats (gemv, gemv_fast, marlin, exllama), Marlin-packed GPTQ, 2/3-bit GPTQ,
compressed-tensors with quantized activations (not W4A16) or mixed with 8-bit groups.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
from jaxtyping import Float, Int

from jengine.errors import CheckpointError

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
GPTQ_BITS = (2, 4, 8)  # fields within whole int32 words (3-bit ones straddle words)


@dataclasses.dataclass(frozen=True)
class Unpacked:
    """One projection in our `[in K, out N]` orientation."""

    values: Int[np.ndarray, "K N"]  # unsigned integers 0 … 2^bits − 1 (compressed-tensors' signed ones + 8)
    zeros: Int[np.ndarray, "G N"]  # in the same unsigned scale
    scales: Float[np.ndarray, "G N"]
    g_idx: Int[np.ndarray, " K"]  # each input row's group

    @property
    def perm(self) -> np.ndarray | None:
        """The input-row order making each group contiguous (apply to the rows once at load, and to the
        activations' features), or None when they already are."""
        if np.all(np.diff(self.g_idx) >= 0):
            return None
        return np.argsort(self.g_idx, kind="stable")

    def dequantize(self) -> Float[np.ndarray, "K N"]:
        """The float32 weight: (q − z) · s of each row's group."""
        rows = self.g_idx
        return (self.values.astype(np.float32) - self.zeros[rows].astype(np.float32)) * self.scales[rows]


def _words_to_fields(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words `[..., W]` → their fields `[..., W, 32/bits]`, field i at bits i·bits (little end first)."""
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    return (words.astype(np.uint32)[..., None] >> shifts) & np.uint32((1 << bits) - 1)


def _along_last(words: np.ndarray, bits: int) -> np.ndarray:
    """Fields packed along the last axis, in order: `[R, W]` → `[R, W · 32/bits]`."""
    return _words_to_fields(words, bits).reshape(*words.shape[:-1], -1)


def _along_first(words: np.ndarray, bits: int) -> np.ndarray:
    """Fields packed along the first axis, in order: `[W, C]` → `[W · 32/bits, C]`."""
    return np.moveaxis(_words_to_fields(words, bits), -1, 1).reshape(-1, words.shape[-1])


def _groups(k: int, group_size: int) -> np.ndarray:
    """Each of `k` input rows' group: consecutive groups of `group_size` (≤ 0, AWQ's and GPTQ's -1: one group)."""
    return np.arange(k, dtype=np.int32) // (group_size if group_size > 0 else max(k, 1))


def unpack_awq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group_size: int) -> Unpacked:
    def columns(words: np.ndarray) -> np.ndarray:
        fields = _words_to_fields(words, 4)  # [rows, N/8, nibble]
        ordered = np.empty_like(fields)
        ordered[..., list(AWQ_ORDER)] = fields  # nibble i → column AWQ_ORDER[i]
        return ordered.reshape(words.shape[0], -1)

    values, zeros = columns(qweight), columns(qzeros)
    rows = _groups(values.shape[0], group_size)
    _check_shapes("AWQ", values, zeros, scales, group_size, int(rows[-1]) + 1 if len(rows) else 0)
    return Unpacked(values.astype(np.uint8), zeros.astype(np.int16), np.asarray(scales, np.float32), rows)


def unpack_gptq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None,
                bits: int, group_size: int, zeros_one_less: bool) -> Unpacked:
    """`zeros_one_less`: GPTQ v1 checkpoints (`checkpoint_format: "gptq"`)."""
    values = _along_first(qweight, bits)
    zeros = gptq_zero_points(qzeros, bits, zeros_one_less, values.shape[1])
    k = values.shape[0]
    rows = np.asarray(g_idx, np.int32) if g_idx is not None else _groups(k, group_size)
    if rows.shape != (k,) or rows.min() < 0 or rows.max() >= scales.shape[0]:
        raise CheckpointError(f"GPTQ g_idx has shape {rows.shape} / values outside the {scales.shape[0]} groups")
    return Unpacked(values.astype(np.uint8), zeros, np.asarray(scales, np.float32), rows)


def gptq_zero_points(qzeros: np.ndarray, bits: int, zeros_one_less: bool, n: int) -> np.ndarray:
    """GPTQ's `qzeros` `[groups, N·bits/32]` → `[groups, N]` zero points (v1 stores each one less)."""
    return (_along_last(qzeros, bits).astype(np.int16) + (1 if zeros_one_less else 0))[:, :n]


def ct_group_size(k: int, groups: int, group_sizes: tuple[int, ...] = ()) -> int:
    """The inputs a group of a `k`-input compressed-tensors weight with `groups` scale columns spans: the config's
    group size whose ⌈k / size⌉ is that many (the last group short where k is not a multiple), k for one group."""
    if groups == 1:
        return k
    size = next((g for g in group_sizes if g > 0 and -(-k // g) == groups), 0)
    if not size and not group_sizes and k % groups == 0:
        size = k // groups
    if not size:
        raise CheckpointError(f"compressed-tensors: {groups} scale groups fit no group size of the config "
                              f"({', '.join(map(str, group_sizes)) or 'none'}) over {k} inputs")
    return size


def ct_group_rows(k: int, groups: int, g_idx: np.ndarray | None, group_sizes: tuple[int, ...] = ()) -> np.ndarray:
    """Each of a compressed-tensors weight's `k` input rows' group: its stored `weight_g_idx`, else consecutive
    groups of the config's size (`ct_group_size`)."""
    return np.asarray(g_idx, np.int32) if g_idx is not None else _groups(k, ct_group_size(k, groups, group_sizes))


def unpack_compressed_tensors(packed: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None,
                              shape: tuple[int, int], g_idx: np.ndarray | None = None,
                              group_sizes: tuple[int, ...] = ()) -> Unpacked:
    """4-bit `pack-quantized`; `scale` `[N, groups]` (one group for the channel strategy); `group_sizes`: the
    config's group sizes (`ct_group_size`)."""
    n, k = shape
    values = _along_last(packed, 4)[:, :k].T  # [K, N], stored signed + 8
    groups = scale.shape[1]
    zeros = (np.full((groups, n), 8, np.int16) if zero_point is None
             else (_along_first(zero_point, 4)[:n].T.astype(np.int16)))
    rows = ct_group_rows(k, groups, g_idx, group_sizes)
    return Unpacked(values.astype(np.uint8), zeros, np.asarray(scale, np.float32).T, rows)


def _check_shapes(kind: str, values: np.ndarray, zeros: np.ndarray, scales: np.ndarray, group_size: int,
                  groups: int) -> None:
    if zeros.shape != (groups, values.shape[1]) or scales.shape != (groups, values.shape[1]):
        raise CheckpointError(f"{kind}: qzeros {zeros.shape} / scales {scales.shape} do not fit a "
                              f"{values.shape} weight in groups of {group_size}")
