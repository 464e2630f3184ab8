"""4-bit projections of AWQ / GPTQ / compressed-tensors checkpoints kept packed (`layers/quant4.py:Int4Weight`).

The loader asks `why_dequantized` per dense projection leaf: None means it is repacked into the W4A16 kernel's
layout (`read_int4` → `place_int4`), a sentence means the leaf stays on the float path (the reader dequantizes it)
and the log says why: groups that are not a multiple of 128 (the kernel walks K one group per step of 16·8 rows),
8-bit GPTQ, column counts no power-of-two strip divides, fused parts in different activation orders, tensor
parallelism (the packed leaves are not split across devices yet) and expert stacks (the grouped-matmul kernels
take float or 8-bit experts).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from jengine.layers.quant4 import PACK, Int4Weight, fits_kernel
from jengine.models.quant4 import Unpacked
from jengine.models.quant4_load import Quant4Reader
from jengine.models.weights import FusedSource, LeafSource, Source

logger = logging.getLogger("jengine.models.quant4_load")  # one logger for the 4-bit loading messages
PACKED_LEAVES = ("wqkv", "wo", "w_gate_up", "w_down")
KERNEL_GROUP = 128


@dataclasses.dataclass(frozen=True)
class HostInt4:
    packed: np.ndarray  # [K / 8, N] int32
    zeros: np.ndarray  # [G, N] float16
    scales: np.ndarray  # [G, N] float16 where exact, else float32
    perm: np.ndarray | None  # [K] int32
    group: int


def _parts(leaf: Source) -> tuple[LeafSource, ...]:
    return leaf.parts if isinstance(leaf, FusedSource) else (leaf,)


def _module(leaf: LeafSource) -> str:
    return str(leaf.names).removesuffix(".weight")


def _group(unpacked: Unpacked) -> int:
    """Rows per group once sorted (the loader checks that every group then has this many)."""
    k, groups = unpacked.values.shape[0], unpacked.scales.shape[0]
    return k // groups if k % groups == 0 else 0


def why_dequantized(reader: Quant4Reader, leaf: Source, shards: int) -> str | None:
    """None when the leaf can run packed through the W4A16 kernel, else the reason it is dequantized."""
    if any(p.names.ndim for p in _parts(leaf)):
        return "expert stacks (the MoE kernels take float or 8-bit experts)"
    if reader.quant.bits != 4:
        return f"{reader.quant.bits}-bit weights (the W4A16 kernel takes 4)"
    if shards > 1 or any(p.head_repeat > 1 for p in _parts(leaf)):
        return "tensor parallelism (4-bit leaves are not split across devices yet)"
    rows = [reader.group_rows(_module(p)) for p in _parts(leaf)]
    groups = {len(g_idx) // count if len(g_idx) % count == 0 else 0 for g_idx, count in rows}
    if len(groups) != 1 or (group := groups.pop()) % KERNEL_GROUP or group == 0:
        return f"group size {sorted(groups | {group})} (the W4A16 kernel takes multiples of {KERNEL_GROUP})"
    if any(np.any(np.bincount(g_idx, minlength=count) != group) for g_idx, count in rows):
        return "groups of unequal sizes"
    perms = [sorted_order(g_idx) for g_idx, _ in rows]
    if any((p is None) != (perms[0] is None) or (p is not None and not np.array_equal(p, perms[0])) for p in perms):
        return "fused projections in different activation orders"
    if not fits_kernel(leaf.shape[-1]):
        return f"{leaf.shape[-1]} output features (not a multiple of 16)"
    return None


def sorted_order(g_idx: np.ndarray) -> np.ndarray | None:
    """The input-row order making each group contiguous, or None when the rows already are."""
    return None if np.all(np.diff(g_idx) >= 0) else np.argsort(g_idx, kind="stable")


def _pack_rows(values: np.ndarray) -> np.ndarray:
    """[K, N] 4-bit values → [K / 8, N] int32, row 8r + j of a word at bits 4j."""
    fields = values.astype(np.uint32).reshape(-1, PACK, values.shape[1])
    word = np.zeros((fields.shape[0], fields.shape[2]), np.uint32)
    for j in range(PACK):
        word |= fields[:, j] << np.uint32(4 * j)
    return word.view(np.int32)


def read_int4(reader: Quant4Reader, leaf: Source) -> HostInt4:
    """The leaf's parts unpacked, rows sorted by group once, repacked and fused along the columns."""
    unpacked = [reader.unpacked(_module(p)) for p in _parts(leaf)]
    perm = unpacked[0].perm
    values = [u.values if perm is None else u.values[perm] for u in unpacked]
    zeros = [u.zeros.astype(np.float16) for u in unpacked]
    scales = [u.scales for u in unpacked]

    def fuse(arrays: list[np.ndarray]) -> np.ndarray:
        return leaf.fuse(arrays) if isinstance(leaf, FusedSource) else arrays[0]

    scale = fuse(scales)
    if np.array_equal(scale.astype(np.float16).astype(np.float32), scale):
        scale = scale.astype(np.float16)  # AWQ and GPTQ store float16 scales: keep their bytes
    return HostInt4(_pack_rows(fuse(values)), fuse(zeros), scale,
                    None if perm is None else perm.astype(np.int32), _group(unpacked[0]))


def place_int4(host: HostInt4, path: str, sharding_for, impl: str) -> Int4Weight:
    """On the devices (one device, or replicated: tensor parallelism keeps the float path)."""
    def put(array: np.ndarray | None, name: str) -> jax.Array | None:
        if array is None:
            return None
        sharding = sharding_for(path + name, array.shape)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    return Int4Weight(put(host.packed, ".packed"), put(host.zeros, ".zeros"), put(host.scales, ".scales"),
                      put(host.perm, ".perm"), host.group, impl)


def log_packing(reader: Quant4Reader, packed: int, reasons: dict[str, int]) -> None:
    """One line for the packed projections and one per reason the others were dequantized (counted per module)."""
    quant = reader.quant
    if packed:
        logger.info("quantization: %s; %d projections kept in 4 bits (W4A16 kernel)", quant.label, packed)
    for reason, count in reasons.items():
        logger.info("quantization: %s; %d projections unpacked and dequantized at load to the model dtype, running "
                    "with a float model's memory; why: %s", quant.label, count, reason)


def int4_impl(platform: str) -> str:
    """The kernel on NVIDIA GPUs, the reference elsewhere (tests set `pallas_interpret` here)."""
    return "pallas" if platform == "gpu" else "reference"


def int4_plans(reader: Quant4Reader, flat_sources: list[tuple[str, Source]], shards: int, platform: str) -> dict:
    """Leaf path → ("int4", None, impl) for the projections kept packed; the rest read as float. Logs the split."""
    plans, packed, reasons = {}, 0, {}
    for path, leaf in flat_sources:
        if path.rsplit("['", 1)[-1].rstrip("']") not in PACKED_LEAVES and not _is_expert_projection(path):
            continue
        modules = sum(int(np.prod(p.names.shape)) for p in _parts(leaf))
        reason = why_dequantized(reader, leaf, shards)
        if reason is None:
            plans[path] = ("int4", None, int4_impl(platform))
            packed += modules
        else:
            reasons[reason] = reasons.get(reason, 0) + modules
    log_packing(reader, packed, reasons)
    return plans


def _is_expert_projection(path: str) -> bool:
    return path.rsplit("['", 1)[-1].rstrip("']") in ("we_gate", "we_up", "we_down")
