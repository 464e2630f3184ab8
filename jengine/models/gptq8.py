"""8-bit GPTQ checkpoints (`bits: 8`, e.g. the GPTQ-Int8 releases of Qwen models) kept in 8 bits: a symmetric module's
values minus its midpoint zero (128) are int8 weights with one scale per (group of input rows, output column), which
is the 8-bit path's int8 W8A16 group scheme (`layers/quant.py:QuantizedWeight`, block `group × 1`): dense projections
run its grouped dots, expert stacks the grouped-matmul kernels with block scales.

Kept in 8 bits where every module of a leaf is stored quantized, with equal groups in the rows' natural order and
zero points all at the midpoint; the rest is dequantized at load by the 4-bit reader (an activation order, or
asymmetric zero points, which the 8-bit path has no place for), the log saying why.
"""

from __future__ import annotations

import logging

import numpy as np

from jengine.layers.quant import QuantScheme
from jengine.models.quant4 import Unpacked
from jengine.models.quant4_load import Quant4Reader
from jengine.models.quant4_place import (
    EXPERT_LEAVES, FLOAT_IN_CHECKPOINT, PACKED_LEAVES, _repeat_heads, leaf_modules, log_packing, sorted_order)
from jengine.models.quant_load import HostQuantized, quant8_impl
from jengine.models.weights import FusedSource, LeafSource, Source, leaf_name

logger = logging.getLogger("jengine.models.quant4_load")  # one logger for the integer checkpoints' loading messages
MIDPOINT = 128


def why_not_int8(reader: Quant4Reader, leaf: Source) -> str | None:
    """None when the leaf's modules can run as int8 W8A16 group weights, else why they are dequantized."""
    modules = leaf_modules(leaf)
    if not all(reader.is_packed(m) for m in modules):
        return FLOAT_IN_CHECKPOINT
    rows = [reader.group_rows(m) for m in modules]
    groups = {len(g_idx) // count if len(g_idx) % count == 0 else 0 for g_idx, count in rows}
    if len(groups) != 1 or 0 in groups:
        return f"8-bit groups of {sorted(groups)} rows (one size dividing the rows is kept in 8 bits)"
    if any(np.any(np.bincount(g_idx, minlength=count) != len(g_idx) // count) for g_idx, count in rows):
        return "8-bit groups of unequal sizes"
    if any(sorted_order(g_idx) is not None for g_idx, _ in rows):
        return "8-bit weights in activation order (the 8-bit path keeps input rows in order)"
    if any(np.any(reader.zero_points(m) != MIDPOINT) for m in modules):
        return "asymmetric 8-bit zero points (the 8-bit path has symmetric weights)"
    return None


def read_gptq8(reader: Quant4Reader, leaf: Source) -> HostQuantized:
    """The leaf as int8 `[..., K, N]` weights (values − 128) with float32 scales `[..., K / group, N]`, fused parts
    side by side and KV heads repeated as the float loader does."""
    parts = leaf.parts if isinstance(leaf, FusedSource) else (leaf,)
    read = [_read_part(reader, part) for part in parts]
    weight = leaf.fuse([w for w, _ in read]) if isinstance(leaf, FusedSource) else read[0][0]
    scale = leaf.fuse([s for _, s in read]) if isinstance(leaf, FusedSource) else read[0][1]
    group = weight.shape[-2] // scale.shape[-2]
    return HostQuantized(weight, np.ascontiguousarray(scale, np.float32), None, QuantScheme("int8", None, group, 1))


def _read_part(reader: Quant4Reader, part: LeafSource) -> tuple[np.ndarray, np.ndarray]:
    """(int8 `[..., K, N]`, scales `[..., G, N]`) of one projection or expert stack."""
    unpacked: list[Unpacked] = [reader.unpacked(str(name).removesuffix(".weight")) for name in part.names.flat]
    weights = [_repeat_heads((u.values.astype(np.int16) - MIDPOINT).astype(np.int8), part) for u in unpacked]
    scales = [_repeat_heads(u.scales, part) for u in unpacked]
    stack = part.names.shape
    return (np.stack(weights).reshape(stack + weights[0].shape),
            np.stack(scales).reshape(stack + scales[0].shape))


def int8_plans(reader: Quant4Reader, flat_sources: list[tuple[str, Source]], platform: str) -> dict:
    """Leaf path → ("gptq8", None, impl) for the projections and expert stacks kept in 8 bits; the rest read as
    float (dequantized by the reader). Logs the split."""
    plans, kept, reasons = {}, 0, {}
    impl = quant8_impl(platform)
    for path, leaf in flat_sources:
        if leaf_name(path) not in PACKED_LEAVES + EXPERT_LEAVES:
            continue
        count = len(leaf_modules(leaf))
        reason = why_not_int8(reader, leaf)
        if reason is None:
            plans[path], kept = ("gptq8", None, impl), kept + count
        else:
            reasons[reason] = reasons.get(reason, 0) + count
    if kept:
        logger.info("quantization: %s; %d projections kept in 8 bits (int8 weights, group scales)",
                    reader.quant.label, kept)
    log_packing(reader, 0, reasons)
    return plans
