"""4-bit projections of AWQ / GPTQ / compressed-tensors checkpoints kept packed (`layers/quant4.py:Int4Weight`,
and `Int4Experts` for a MoE layer's expert stacks).

The loader asks `why_dequantized` per dense projection leaf: None means it is repacked into the W4A16 kernel's
layout (`read_int4` → `place_int4`), a sentence means the leaf stays on the float path (the reader dequantizes it)
and the log says why: groups other than 16, 32, 64 or a multiple of 128 rows (the kernel walks K 128 rows a step;
larger groups run as groups of 128), input widths that are not whole steps, column counts no power-of-two strip
divides, fused parts in different activation orders, and under tensor parallelism the splits the kernel cannot run
per device: column-parallel leaves (q/k/v, gate/up) need whole 16-column strips on each device, and row-parallel ones
(o, down) whole steps. Split leaves run the kernel under `shard_map` (`layers/quant4.py`). 8-bit GPTQ goes to
`models/gptq8.py`.

Expert stacks ask `why_experts_dequantized`: the grouped-matmul kernels step through K by whole groups or within
one, so they take any group of a multiple of 16 rows (equal groups), and under tensor parallelism whole groups of
the down projection's rows on each device. Gate and up share a launch (packed both or neither); down has its own,
so a layer may read gate/up packed and down in float (GGUF's Q4_K_M keeps some down projections in Q6_K). GPTQ's
activation order is kept packed: each expert's rows sorted by group, gate's and up's with their order (the kernel
gathers x's features by it; the two must agree), down's folded into gate's and up's output columns
(`layers/quant4.py:Int4Experts`), so an ordered down needs gate and up packed.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jengine.layers.quant4 import PACK, Int4Experts, Int4Weight, fits_kernel, fits_mosaic, to_mosaic
from jengine.models.quant4 import Unpacked
from jengine.models.quant4_load import Quant4Reader
from jengine.models.weights import FusedSource, LeafSource, Source, leaf_name

logger = logging.getLogger("jengine.models.quant4_load")  # one logger for the 4-bit loading messages
PACKED_LEAVES = ("wqkv", "wo", "w_gate_up", "w_down", "ws_gate_up", "ws_down")  # ws_: a shared expert
EXPERT_LEAVES = ("we_gate", "we_up", "we_down")
ROW_PARALLEL = ("wo", "w_down", "ws_down")  # the rest split their output columns (parallel/sharding.py)
KERNEL_GROUP = 128
FLOAT_IN_CHECKPOINT = "some of its modules are not stored in a packed 4-bit format (float, or GGUF's other types)"


@dataclasses.dataclass(frozen=True)
class HostInt4:
    packed: np.ndarray  # [K / 8, N] int32
    zeros: np.ndarray  # [G, N] float16 where exact, else float32
    scales: np.ndarray  # [G, N] float16 where exact, else float32
    perm: np.ndarray | None  # [K] int32
    group: int


def _parts(leaf: Source) -> tuple[LeafSource, ...]:
    return leaf.parts if isinstance(leaf, FusedSource) else (leaf,)


def leaf_modules(leaf: Source) -> list[str]:
    """The checkpoint modules (`model.layers.0.mlp.experts.3.gate_proj`) behind a leaf: each fused part's, each
    stacked expert's."""
    return [str(name).removesuffix(".weight") for part in _parts(leaf) for name in part.names.flat]


def _module(leaf: LeafSource) -> str:
    return str(leaf.names).removesuffix(".weight")


def _group(unpacked: Unpacked) -> int:
    """Rows per group once sorted (the loader checks that every group then has this many)."""
    k, groups = unpacked.values.shape[0], unpacked.scales.shape[0]
    return k // groups if k % groups == 0 else 0


def why_dequantized(reader: Quant4Reader, leaf: Source, shards: int, name: str = "") -> str | None:
    """None when the leaf (named `name`, e.g. `wo`) can run packed through the W4A16 kernel on each of `shards`
    devices, else the reason it is dequantized."""
    if not all(reader.is_packed(_module(p)) for p in _parts(leaf)):
        return FLOAT_IN_CHECKPOINT
    if reader.quant.bits != 4:
        return f"{reader.quant.bits}-bit weights (the W4A16 kernel takes 4)"
    rows = [reader.group_rows(_module(p)) for p in _parts(leaf)]
    groups = {len(g_idx) // count if len(g_idx) % count == 0 else 0 for g_idx, count in rows}
    if len(groups) != 1:
        return f"fused parts in groups of {sorted(groups)} rows"
    if (group := groups.pop()) == 0:
        return "groups of unequal sizes (a short last group)"
    if (reason := shape_reason(*leaf.shape[-2:], kernel_group(group), shards, name)) is not None:
        return reason
    if any(np.any(np.bincount(g_idx, minlength=count) != group) for g_idx, count in rows):
        return "groups of unequal sizes"
    perms = [sorted_order(g_idx) for g_idx, _ in rows]
    if any((p is None) != (perms[0] is None) or (p is not None and not np.array_equal(p, perms[0])) for p in perms):
        return "fused projections in different activation orders"
    return None


def shape_reason(k: int, n: int, group: int, shards: int, name: str) -> str | None:
    """What of a `[k, n]` projection's shape, its group and its split over `shards` devices keeps it from the W4A16
    kernel (None: nothing)."""
    if group == 0 or group % 16 or KERNEL_GROUP % group:
        return f"group size [{group}] (the W4A16 kernel takes 16, 32, 64 or a multiple of {KERNEL_GROUP} rows)"
    if k % KERNEL_GROUP:
        return f"{k} input features (the W4A16 kernel walks K {KERNEL_GROUP} rows a step)"
    if shards > 1 and name in ROW_PARALLEL and k % (shards * KERNEL_GROUP):
        return (f"tensor parallelism: {k} input features over {shards} devices is not whole groups of "
                f"{KERNEL_GROUP} on each")
    if shards > 1 and name not in ROW_PARALLEL and (n % shards or not fits_kernel(n // shards)):
        return f"tensor parallelism: {n} output features over {shards} devices is not a multiple of 16 on each"
    if not fits_kernel(n):
        return f"{n} output features (not a multiple of 16)"
    return None


EXPERT_GROUP_ROWS = 16  # the grouped-matmul kernels' smallest K step (one Triton dot's K)


def why_experts_dequantized(reader: Quant4Reader, leaf: LeafSource, rows_per_device: int) -> str | None:
    """None when an expert stack (one leaf: an HF module per expert) can run packed through the grouped-matmul
    kernels, each device holding `rows_per_device` of its K input rows, else the reason it is dequantized."""
    if not all(reader.is_packed(module) for module in leaf_modules(leaf)):
        return FLOAT_IN_CHECKPOINT
    if reader.quant.bits != 4:
        return f"{reader.quant.bits}-bit expert weights (the grouped-matmul kernels take 4-bit ones packed)"
    rows = [reader.group_rows(module) for module in leaf_modules(leaf)]
    groups = {len(g_idx) // count if len(g_idx) % count == 0 else 0 for g_idx, count in rows}
    if len(groups) != 1:
        return f"experts in groups of {sorted(groups)} rows"
    if (reason := expert_shape_reason(group := groups.pop(), rows_per_device)) is not None:
        return reason
    if any(np.any(np.bincount(g_idx, minlength=count) != group) for g_idx, count in rows):
        return "expert groups of unequal sizes"
    return None


def expert_shape_reason(group: int, rows_per_device: int) -> str | None:
    """What of an expert stack's group and split keeps it from the grouped-matmul kernels (None: nothing)."""
    if group == 0 or group % EXPERT_GROUP_ROWS:
        return f"expert groups of [{group}] rows (the grouped-matmul kernels take multiples of {EXPERT_GROUP_ROWS})"
    if rows_per_device % group:
        return (f"tensor parallelism: {rows_per_device} of the experts' input rows on each device is not whole "
                f"groups of {group}")
    return None


def _row_orders(reader: Quant4Reader, leaf: LeafSource) -> list[np.ndarray | None]:
    """Each expert's stored row order (rows sorted by group, GPTQ's activation order), None where natural."""
    return [sorted_order(reader.group_rows(module)[0]) for module in leaf_modules(leaf)]


def why_gate_up_apart(reader: Quant4Reader, gate: LeafSource, up: LeafSource) -> str | None:
    """The kernels gather x's features once for gate and up: their row orders must agree expert by expert (both
    stored packed: `why_experts_dequantized` asked first)."""
    for g, u in zip(_row_orders(reader, gate), _row_orders(reader, up), strict=True):
        if (g is None) != (u is None) or (g is not None and not np.array_equal(g, u)):
            return "experts' gate and up projections in different activation orders"
    return None


@dataclasses.dataclass(frozen=True)
class HostInt4Experts:
    packed: np.ndarray  # [E, K / 8, N] int32
    zeros: np.ndarray  # [E, G, N] float16 where exact, else float32
    scales: np.ndarray  # [E, G, N] float16 where exact, else float32
    perm: np.ndarray | None  # [E, K] int32: stored row k of expert e is input feature perm[e, k]


def read_int4_experts(reader: Quant4Reader, leaf: LeafSource, down: LeafSource | None = None) -> HostInt4Experts:
    """Each expert's module unpacked, its rows sorted by group, repacked into the kernels' words and stacked. `down`
    (given for gate and up): the layer's down projection, whose row order (activation order) the output columns
    take, so the hidden features reach down in its stored row order (`layers/quant4.py:Int4Experts`)."""
    unpacked = [reader.unpacked(module) for module in leaf_modules(leaf)]
    rows = _row_orders(reader, leaf)
    columns = _row_orders(reader, down) if down is not None else [None] * len(unpacked)

    def stored(array: np.ndarray, row: np.ndarray | None, column: np.ndarray | None) -> np.ndarray:
        array = array if row is None else array[row]
        return array if column is None else array[:, column]

    values = [_pack_rows(stored(u.values, r, c)) for u, r, c in zip(unpacked, rows, columns)]
    zeros = compact(np.stack([stored(u.zeros.astype(np.float32), None, c) for u, c in zip(unpacked, columns)]))
    scales = compact(np.stack([stored(u.scales, None, c) for u, c in zip(unpacked, columns)]))
    perm = None
    if any(r is not None for r in rows) and down is not None:  # down's own order went into gate's and up's columns
        k = unpacked[0].values.shape[0]
        perm = np.stack([np.arange(k) if r is None else r for r in rows]).astype(np.int32)
    return HostInt4Experts(np.stack(values), np.stack(zeros), scales, perm)


def place_int4_experts(host: HostInt4Experts, path: str, sharding_for) -> Int4Experts:
    """On the devices where the layout puts the float stack's experts, columns or rows (`parallel/sharding.py`); the
    row order split as the experts are (every device holds its experts' whole input rows)."""
    packed_sharding = sharding_for(path + ".packed", host.packed.shape)
    perm_sharding = packed_sharding
    if isinstance(packed_sharding, NamedSharding):
        perm_sharding = NamedSharding(packed_sharding.mesh, P((tuple(packed_sharding.spec) + (None,))[0], None))
    return Int4Experts(_put(host.packed, packed_sharding),
                       _put(host.zeros, sharding_for(path + ".zeros", host.zeros.shape)),
                       _put(host.scales, sharding_for(path + ".scales", host.scales.shape)),
                       _put(host.perm, perm_sharding))


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
    parts = _parts(leaf)
    unpacked = [reader.unpacked(_module(p)) for p in parts]
    perm = unpacked[0].perm
    values = [_repeat_heads(u.values if perm is None else u.values[perm], p) for u, p in zip(unpacked, parts)]
    zeros = [_repeat_heads(u.zeros.astype(np.float32), p) for u, p in zip(unpacked, parts)]
    scales = [_repeat_heads(u.scales, p) for u, p in zip(unpacked, parts)]

    def fuse(arrays: list[np.ndarray]) -> np.ndarray:
        return leaf.fuse(arrays) if isinstance(leaf, FusedSource) else arrays[0]

    scale, zero = compact(fuse(scales)), compact(fuse(zeros))
    group = _group(unpacked[0])
    repeat = group // kernel_group(group)  # larger groups as runs of the kernel's, sharing their scale and zero
    return HostInt4(_pack_rows(fuse(values)), np.repeat(zero, repeat, axis=0), np.repeat(scale, repeat, axis=0),
                    None if perm is None else perm.astype(np.int32), group // repeat)


def compact(array: np.ndarray) -> np.ndarray:
    """float16 where that is exact (AWQ and GPTQ store float16 scales, integer zero points: keep their bytes), else
    float32 (GGUF Q4_K's products of two scales and fractional zero points)."""
    array = np.asarray(array, np.float32)
    return array.astype(np.float16) if np.array_equal(array.astype(np.float16).astype(np.float32), array) else array


def kernel_group(group: int) -> int:
    """The group a projection runs in: a multiple of 128 rows (a channel-wise one too) as groups of 128 sharing its
    scale and zero point; smaller groups (16, 32, 64) as they are. The kernel walks K 128 rows a step, with one
    zero point and scale per step or per word row: a group of 14,336 rows (Llama's down_proj, channel-wise) would
    be neither a power of two, which Triton needs, nor a register tile."""
    return KERNEL_GROUP if group % KERNEL_GROUP == 0 else group


def _repeat_heads(array: np.ndarray, part: LeafSource) -> np.ndarray:
    """A K/V part's columns with each head repeated, as `LeafSource.from_checkpoint` repeats a float weight's."""
    if part.head_repeat == 1:
        return array
    heads = array.reshape(array.shape[0], -1, part.head_dim)
    return np.repeat(heads, part.head_repeat, axis=1).reshape(array.shape[0], -1)


def place_int4(host: HostInt4, path: str, sharding_for, impl: str) -> Int4Weight:
    """On the devices, where the layout puts the float leaf's rows or columns; the row order `perm` replicated
    (the activations are gathered by it before any split)."""
    packed_sharding = sharding_for(path + ".packed", host.packed.shape)
    mesh, split = split_of(packed_sharding)
    weight = Int4Weight(_put(host.packed, packed_sharding),
                        _put(host.zeros, sharding_for(path + ".zeros", host.zeros.shape)),
                        _put(host.scales, sharding_for(path + ".scales", host.scales.shape)),
                        _put(host.perm, NamedSharding(mesh, P()) if mesh else packed_sharding), host.group,
                        words_impl(impl), mesh=mesh if split else None, split=split)
    # the zero points are scanned only where the Mosaic layout is asked for
    return in_kernel_layout(weight, impl, exact_zeros=impl.startswith("mosaic") and exact_in_bfloat16(host.zeros))


def exact_in_bfloat16(zeros: np.ndarray) -> bool:
    """Whether every nibble minus these zero points (0 … 15) is exact in bfloat16: multiples of 1/8 are."""
    eighths = np.asarray(zeros, np.float64) * 8
    return bool(np.all(eighths == np.round(eighths)))


def words_impl(impl: str) -> str:
    """The implementation a weight is placed with: the Triton kernels' words layout, converted later for Mosaic."""
    return {"mosaic": "pallas", "mosaic_interpret": "pallas_interpret"}.get(impl, impl)


def in_kernel_layout(weight: Int4Weight, impl: str, exact_zeros: bool = True) -> Int4Weight:
    """`weight` (words layout) in the layout of `impl`'s kernel: the Mosaic one where its tiles fit each device's
    share and its zero points are multiples of 1/8 (`exact_in_bfloat16`: the kernel subtracts them from bfloat16
    weights; GGUF Q4_K's arbitrary ones stay with the Triton kernels, as does everything else that does not fit)."""
    k, n = weight.shape
    shards = weight.mesh.size if weight.mesh is not None else 1
    if impl.startswith("mosaic") and exact_zeros and fits_mosaic(k, n, weight.group, shards, weight.split):
        return to_mosaic(weight, interpret=impl == "mosaic_interpret")
    return weight


def _put(array: np.ndarray | None, sharding) -> jax.Array | None:
    """A host array on the devices where `sharding` puts it, each device reading only its slice (None stays None)."""
    if array is None:
        return None
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def split_of(sharding) -> tuple:
    """(mesh, "rows" | "columns" | None) of a packed `[K / 8, N]` leaf's sharding."""
    if not isinstance(sharding, NamedSharding):
        return None, None
    spec = tuple(sharding.spec) + (None, None)
    return sharding.mesh, "rows" if spec[0] is not None else "columns" if spec[1] is not None else None


def log_packing(reader: Quant4Reader, packed: int, reasons: dict[str, int]) -> None:
    """One line for the packed projections and one per reason the others were dequantized (counted per module)."""
    quant = reader.quant
    if packed:
        logger.info("quantization: %s; %d projections kept in 4 bits (W4A16 and grouped-matmul kernels)",
                    quant.label, packed)
    for reason, count in reasons.items():
        if reason == FLOAT_IN_CHECKPOINT:
            logger.info("quantization: %s; %d projections run in the model dtype: their leaf (a fused projection or "
                        "an expert stack) has modules not stored in a packed 4-bit format", quant.label, count)
            continue
        logger.info("quantization: %s; %d projections unpacked and dequantized at load to the model dtype, running "
                    "with a float model's memory; why: %s", quant.label, count, reason)


# The Mosaic weight-only kernel (`layers/quant4.py`'s `mosaic` layout) on Hopper GPUs: the 32-layer model step on an
# H100 took 3.75 ms at batch 1 against the Triton kernels' 4.19 (bf16 6.09) and 8.84 against 9.60 at batch 64
# (benchmarks/README.md, "The Mosaic GPU weight-only kernel"); GGUF Q4_K keeps the Triton layout (`in_kernel_layout`).
MOSAIC_ON_HOPPER = True


def int4_impl(platform: str) -> str:
    """The kernels on NVIDIA GPUs, the reference elsewhere (tests set `pallas_interpret` or `mosaic_interpret`)."""
    if platform != "gpu":
        return "reference"
    from pallas_kernels.ragged_paged_attention.mosaic_prefill import on_hopper

    return "mosaic" if MOSAIC_ON_HOPPER and on_hopper() else "pallas"


def int4_plans(reader: Quant4Reader, flat_sources: list[tuple[str, Source]], shards: int, platform: str,
               sharding_for=None) -> dict:
    """Leaf path → ("int4", None, impl) for the projections kept packed, ("int4_experts", None, None) for the expert
    stacks kept packed; the rest read as float. Logs the split. `sharding_for` (the loader's placement callback)
    tells how many devices split an expert stack's input rows (tensor parallelism splits the down projection's;
    expert parallelism none)."""
    plans, packed, reasons = {}, 0, {}
    expert_layers: dict[str, list[tuple[str, Source]]] = {}
    for path, leaf in flat_sources:
        name = leaf_name(path)
        if name in EXPERT_LEAVES:
            expert_layers.setdefault(path.rsplit("[", 1)[0], []).append((path, leaf))
        elif name in PACKED_LEAVES:
            reason = why_dequantized(reader, leaf, shards, name)
            packed += _count(plans, reasons, path, leaf, reason, ("int4", None, int4_impl(platform)))
    for stacks in expert_layers.values():
        gate_up_reason, down_reason = _expert_reasons(reader, dict(stacks), sharding_for)
        down = next(leaf for path, leaf in stacks if leaf_name(path) == "we_down")
        for path, leaf in stacks:
            if leaf_name(path) == "we_down":
                packed += _count(plans, reasons, path, leaf, down_reason, ("int4_experts", None, None))
            else:  # gate and up take a packed down's row order as their columns
                order = down if down_reason is None else None
                packed += _count(plans, reasons, path, leaf, gate_up_reason, ("int4_experts", order, None))
    log_packing(reader, packed, reasons)
    return plans


def _expert_reasons(reader: Quant4Reader, stacks: dict[str, LeafSource], sharding_for) -> tuple:
    """(why gate and up are dequantized, why down is; None: packed). Gate and up share one launch: packed both or
    neither. A down projection in activation order needs gate and up packed, whose columns take its order."""
    by_name = {leaf_name(path): (path, leaf) for path, leaf in stacks.items()}

    def why(name: str) -> str | None:
        path, leaf = by_name[name]
        return why_experts_dequantized(reader, leaf, rows_per_device(sharding_for, path, leaf))

    gate, up = by_name["we_gate"][1], by_name["we_up"][1]
    gate_up = why("we_gate") or why("we_up") or why_gate_up_apart(reader, gate, up)
    down = why("we_down")
    if down is None and gate_up is not None and any(o is not None for o in
                                                     _row_orders(reader, by_name["we_down"][1])):
        down = "the down projection's activation order needs gate and up packed"
    return gate_up, down


def rows_per_device(sharding_for, path: str, leaf: LeafSource) -> int:
    """The input rows of an expert stack each device holds where `sharding_for` places its packed words."""
    experts, k, n = leaf.shape
    sharding = None if sharding_for is None else sharding_for(path + ".packed", (experts, k // PACK, n))
    if not isinstance(sharding, NamedSharding):
        return k
    axis = (tuple(sharding.spec) + (None,) * 3)[1]
    names = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
    return k // int(np.prod([sharding.mesh.shape[a] for a in names]))


def _count(plans: dict, reasons: dict, path: str, leaf: Source, reason: str | None, plan: tuple) -> int:
    """Records the leaf's plan (kept packed) or its reason (dequantized); returns the modules kept packed."""
    modules = sum(int(np.prod(p.names.shape)) for p in _parts(leaf))
    if reason is not None:
        reasons[reason] = reasons.get(reason, 0) + modules
        return 0
    plans[path] = plan
    return modules
