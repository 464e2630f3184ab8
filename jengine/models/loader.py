"""HF checkpoint directory → (ModelSpec, parameter pytree on devices).

Each parameter is built with `jax.make_array_from_callback`: every device shard reads only its slice of the
memory-mapped safetensors files, casts it and goes straight to its device, so the host never holds the model twice
(at most one stacked parameter kind at a time, for an unsharded array).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jengine.errors import CheckpointError, ConfigError
from jengine.models.checkpoint import CheckpointReader, checkpoint_dtype
from jengine.models.converted import converted_metadata, restore_converted, save_converted
from jengine.models.device_transpose import DeviceTranspose
from jengine.models.formats import open_checkpoint, read_model_config, unpacked_at_open
from jengine.models.gguf.reader import GGUFCheckpoint
from jengine.models.gptq8 import int8_plans, read_gptq8
from jengine.models.quant4_load import Quant4Reader
from jengine.models.quant4_place import int4_plans, place_int4, place_int4_experts, read_int4, read_int4_experts
from jengine.models.quant_config import QuantConfig, read_quant_config
from jengine.models.quant_load import (
    QUANTIZED_LEAVES, dequantized_float, leaf_quant, module_quant, place, quant8_impl, read_leaf)
from jengine.models.registry import spec_from_hf_config
from jengine.models.spec import ModelSpec
from jengine.models.weights import (
    EMBEDDING, KV_SCALE_TEMPLATES, LM_HEAD, FusedSource, LeafSource, Source, is_source, kv_scale_names, leaf_name,
    parameter_sources, stacked_block)
from jengine.progress import progress_bar

logger = logging.getLogger(__name__)

LOAD_THREADS = 4  # leaves read, transposed and placed at once (each holds its host copy until placed)

DTYPE_NAMES = {
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "fp16": jnp.float16, "half": jnp.float16,
    "float32": jnp.float32, "fp32": jnp.float32, "float": jnp.float32,
}
_FLOAT_KINDS = (np.float16, np.float32, np.float64, jnp.bfloat16)

ShardingFor = Callable[[str, tuple[int, ...]], jax.sharding.Sharding]


def resolve_dtype(requested: str, checkpoint: str | np.dtype | None, platform: str) -> jnp.dtype:
    """`auto` is the checkpoint's dtype, except that float32 checkpoints run in bfloat16 on GPUs."""
    if requested != "auto":
        if requested not in DTYPE_NAMES:
            raise ConfigError(f"unsupported dtype {requested!r}; choose auto, bfloat16, float16 or float32")
        return jnp.dtype(DTYPE_NAMES[requested])
    dtype = jnp.dtype(DTYPE_NAMES.get(str(checkpoint), checkpoint or jnp.float32))
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        dtype = jnp.dtype(jnp.float32)
    if dtype == jnp.float32 and platform == "gpu":
        return jnp.dtype(jnp.bfloat16)
    return dtype


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Only the config: the architecture is checked before any weight is touched."""
    return spec_from_hf_config(read_model_config(model_dir))


def load_model(
    model_dir: str | Path,
    dtype: str = "auto",
    sharding: jax.sharding.Sharding | ShardingFor | None = None,
    progress: bool = True,
    converted_dir: str | Path | None = None,
    kv_head_repeat: int = 1,
    projection_shards: int = 1,
    quantization: str | None = None,
    transpose_on_device: bool | None = None,
) -> tuple[ModelSpec, dict, jnp.dtype]:
    """Reads, checks, casts and places every parameter; returns (spec, params, dtype).

    `kv_head_repeat` > 1 (tensor parallelism beyond the KV-head count) repeats each KV head that many times; the
    returned spec then counts the repeated heads, so the model and the KV cache see one head per device.
    `projection_shards`: the tensor-parallel size; the fused q/k/v and gate/up columns are grouped per shard (see
    `models/weights.py`), and the returned spec records it for the model to split them.

    With `converted_dir`, a conversion saved there for the same checkpoint, dtype and layout is restored instead (fast
    start-up), and a fresh conversion is saved there otherwise (float models only).

    `quantization` is vLLM's `--quantization`: None reads the checkpoint's own `quantization_config`; `fp8` also
    quantizes a float checkpoint at load (`models/quant_config.py`). The 8-bit projections become `QuantizedWeight`s.

    `transpose_on_device` (default: on accelerators) turns the [out, in] projections on the device instead of the
    host (`models/device_transpose.py`); the result is the same either way.
    """
    spec = load_spec(model_dir)
    config = read_model_config(model_dir)
    # GGUF files and 4-bit checkpoints are read as float ones (their reader dequantizes); 8-bit ones are planned here
    four_bit = unpacked_at_open(config, quantization)
    quant = None if four_bit else read_quant_config(config, quantization)
    if quant is not None or four_bit:  # saved conversions hold float leaves only
        converted_dir = None
    with open_checkpoint(model_dir) as reader:
        spec = _tied_as_in_the_checkpoint(spec, reader)
        platform = jax.devices()[0].platform
        resolved = resolve_dtype(dtype, spec.checkpoint_dtype or checkpoint_dtype(reader), platform)
        sharding_for = _sharding_function(sharding)
        sources = parameter_sources(spec, kv_head_repeat, projection_shards)
        kv_scales = load_kv_scales(reader, spec, kv_head_repeat)
        spec = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads * kv_head_repeat,
                                   projection_shards=projection_shards)
        if isinstance(reader, GGUFCheckpoint) and reader.has_int4:  # 4-bit leaves: no float conversion to save
            converted_dir = None
        fingerprint = _fingerprint(reader, resolved, kv_head_repeat, projection_shards) if converted_dir else None
        if converted_dir and (converted_metadata(converted_dir) or {}).get("fingerprint") == fingerprint:
            logger.info("restoring converted weights from %s", converted_dir)
            params = restore_converted(converted_dir, _abstract_params(sources, resolved, sharding_for))
            return spec, _with_kv_scales(params, spec, kv_scales, sharding_for), resolved
        plans = _all_plans(reader, sources, quant, platform, projection_shards, sharding_for)
        _check_sources(reader, sources, plans)
        on_device = platform != "cpu" if transpose_on_device is None else transpose_on_device
        params = _place_all(reader, sources, resolved, sharding_for, progress, plans,
                            DeviceTranspose() if on_device else None)
    if quant is not None:
        _log_quantized(quant, plans, params, resolved)
    if converted_dir:
        save_converted(converted_dir, params, {"fingerprint": fingerprint, "source": str(model_dir)})
    logger.info("loaded %s (%s) from %s in %s", spec.architecture, spec.family, model_dir, resolved.name)
    return spec, _with_kv_scales(params, spec, kv_scales, sharding_for), resolved


def _tied_as_in_the_checkpoint(spec: ModelSpec, reader: CheckpointReader) -> ModelSpec:
    """A config that ties the LM head to the embedding, in a checkpoint that also holds a different lm_head.weight:
    that head is used, as HF transformers 5 does (an identical copy keeps the tie, and no second array)."""
    if not spec.tie_word_embeddings or LM_HEAD not in reader:
        return spec
    if np.array_equal(reader.read(LM_HEAD), reader.read(EMBEDDING)):
        return spec
    logger.warning("%s: tie_word_embeddings is true but the checkpoint's lm_head.weight differs from the embedding; "
                   "using lm_head.weight, as HF transformers does", reader.model_dir)
    return dataclasses.replace(spec, tie_word_embeddings=False)


# Changes whenever the parameter pytree's structure does, so older saved conversions are converted again.
PARAMS_LAYOUT = "one-array-per-layer, fused qkv and gate_up"


def _fingerprint(reader: CheckpointReader, dtype: jnp.dtype, kv_head_repeat: int, shards: int) -> str:
    """Identifies a conversion: the config, every tensor's name/shape/dtype/file size and modification time (so a
    checkpoint re-saved with new weights of the same shapes is converted again), and the target dtype."""
    tensors = [(n, reader.shape(n), str(reader.dtype(n)), _file_stamp(reader.info(n).file)) for n in reader.names()]
    payload = json.dumps([reader.config(), tensors, dtype.name, kv_head_repeat, shards, PARAMS_LAYOUT],
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def _file_stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _abstract_params(sources: dict, dtype: jnp.dtype, sharding_for: ShardingFor) -> dict:
    flat, treedef = jax.tree_util.tree_flatten_with_path(sources, is_leaf=is_source)
    return jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding_for(jax.tree_util.keystr(path), leaf.shape))
        for path, leaf in flat
    ])


def _sharding_function(sharding: jax.sharding.Sharding | ShardingFor | None) -> ShardingFor:
    if sharding is None:
        device = jax.devices()[0]
        return lambda path, shape: jax.sharding.SingleDeviceSharding(device)
    if isinstance(sharding, jax.sharding.Sharding):
        return lambda path, shape: sharding
    return sharding


def _check_sources(reader: CheckpointReader, sources: dict, plans: dict) -> None:
    """Every tensor present, with the shape the config implies and a floating dtype, before any is read (8-bit
    leaves are checked as they are read)."""
    float_sources = {k: v for k, v in _flat_sources(sources) if plans.get(k) is None}
    for leaf in _single_tensors(float_sources):
        expected = leaf.checkpoint_shape
        for name in leaf.names.flat:
            reader.info(name)  # raises CheckpointError naming the missing tensor
            if tuple(reader.shape(name)) != expected:
                raise CheckpointError(
                    f"tensor {name} has shape {tuple(reader.shape(name))}, but config.json implies {expected}"
                )
            if reader.dtype(name).type not in _FLOAT_KINDS:
                raise CheckpointError(
                    f"tensor {name} has dtype {reader.dtype(name)}; only float16/bfloat16/float32 weights are "
                    "supported without a quantization_config (an 8-bit checkpoint names its format there)"
                )


def _single_tensors(sources: dict) -> Iterator[LeafSource]:
    """Every LeafSource, the parts of fused ones included."""
    for source in jax.tree.leaves(sources, is_leaf=is_source):
        yield from (source.parts if isinstance(source, FusedSource) else (source,))


def _flat_sources(sources: dict) -> list[tuple[str, Source]]:
    return [(jax.tree_util.keystr(path), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(sources, is_leaf=is_source)[0]]


def _quant_plans(reader: CheckpointReader, sources: dict, quant: QuantConfig | None, platform: str) -> dict:
    """Leaf path → ("run", ModuleQuant) for a projection run in 8 bits, ("float", ModuleQuant) for an 8-bit
    module run in float (a quantized LM head), absent for float leaves."""
    if quant is None:
        return {}
    plans = {}
    for path, leaf in _flat_sources(sources):
        name = leaf_name(path)
        if name in QUANTIZED_LEAVES:
            how = leaf_quant(quant, reader, leaf)
            if how is not None:
                plans[path] = ("run", how, quant8_impl(platform))
        elif name == "lm_head" and quant.method != "fp8-at-load":
            how = module_quant(quant, reader, "lm_head")
            if how is not None:
                plans[path] = ("float", how, None)
    return plans


def _all_plans(reader: CheckpointReader, sources: dict, quant: QuantConfig | None, platform: str, shards: int,
               sharding_for: ShardingFor) -> dict:
    """Leaf path → how it is read and placed (absent: float): 8-bit leaves from the quantization_config; a 4-bit
    checkpoint's projections packed where the kernels take them (8-bit GPTQ onto the 8-bit path); a GGUF file's
    Q4_0/Q4_K projections likewise, beside its Q8_0 ones."""
    plans = _quant_plans(reader, sources, quant, platform)
    flat = _flat_sources(sources)
    if isinstance(reader, Quant4Reader) and reader.quant.bits == 8:
        return int8_plans(reader, flat, platform)
    if isinstance(reader, Quant4Reader):
        return int4_plans(reader, flat, shards, platform, sharding_for)
    if isinstance(reader, GGUFCheckpoint) and reader.has_int4:
        return plans | int4_plans(reader, [(p, leaf) for p, leaf in flat if p not in plans], shards, platform,
                                  sharding_for)
    return plans


def _log_quantized(quant: QuantConfig, plans: dict, params: dict, dtype: jnp.dtype) -> None:
    run = [path for path, plan in plans.items() if plan[0] == "run"]
    schemes = sorted({plan[1].scheme.label for plan in plans.values() if plan[0] in ("run", "float")})
    four_bit = sum(plan[0].startswith("int4") for plan in plans.values())
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    logger.info("quantization: %s; %d projections in 8 bits (%s), %d leaves in 4 bits, the rest in %s; weights "
                "take %.2f GiB", quant.label, len(run), ", ".join(schemes), four_bit, dtype.name, total / (1 << 30))
    for path, plan in plans.items():
        if plan[0] == "float":
            logger.info("%s is stored in 8 bits and runs dequantized to %s", path, dtype.name)


def _place_all(reader: CheckpointReader, sources: dict, dtype: jnp.dtype, sharding_for: ShardingFor, progress: bool,
               plans: dict, device_transpose: DeviceTranspose | None):
    paths_and_leaves = jax.tree_util.tree_flatten_with_path(sources, is_leaf=is_source)
    flat, treedef = paths_and_leaves
    total = sum(int(np.prod(leaf.shape)) * dtype.itemsize for _, leaf in flat)
    placed = []
    # Leaves load on a few threads: the transposes and casts of one (numpy, without the GIL) overlap another's
    # transfer to the device.
    with (ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="weights") as pool,
          progress_bar(total=total, unit="B", unit_scale=True, desc="Loading weights", enabled=progress) as bar):
        futures = [pool.submit(_place_any, reader, leaf, dtype, sharding_for, jax.tree_util.keystr(path),
                               plans.get(jax.tree_util.keystr(path)), device_transpose)
                   for path, leaf in flat]
        for future, (_, leaf) in zip(futures, flat, strict=True):
            placed.append(future.result())
            bar.update(int(np.prod(leaf.shape)) * dtype.itemsize)
    return jax.tree.unflatten(treedef, placed)



def _place_any(reader: CheckpointReader, leaf: Source, dtype: jnp.dtype, sharding_for: ShardingFor, path: str,
               plan: tuple | None, device_transpose: DeviceTranspose | None):
    """A float leaf, an 8-bit one (`QuantizedWeight`), or an 8-bit module dequantized to `dtype`."""
    if plan is None:
        sharding = sharding_for(path, leaf.shape)
        placed = None if device_transpose is None else device_transpose.place(reader, leaf, dtype, sharding)
        return _place_leaf(reader, leaf, dtype, sharding) if placed is None else placed
    kind, how, impl = plan
    if kind == "int4":
        return place_int4(read_int4(reader, leaf), path, sharding_for, impl)
    if kind == "int4_experts":  # `how`: the layer's down projection, for gate and up
        return place_int4_experts(read_int4_experts(reader, leaf, how), path, sharding_for)
    if kind == "gptq8":
        return place(read_gptq8(reader, leaf), path, sharding_for, impl)
    if kind == "run":
        return place(read_leaf(reader, leaf, how), path, sharding_for, impl)
    full = np.asarray(dequantized_float(reader, str(leaf.names), how), dtype=dtype)
    return jax.make_array_from_callback(leaf.shape, sharding_for(path, leaf.shape), lambda index: full[index])


def _place_leaf(reader: CheckpointReader, leaf: Source, dtype: jnp.dtype, sharding) -> jax.Array:
    if isinstance(leaf, FusedSource):
        return _place_fused(reader, leaf, dtype, sharding)

    def in_our_layout(name: str) -> np.ndarray:
        return leaf.from_checkpoint(reader.read(name))

    def owned_block(index: tuple[slice, ...]) -> np.ndarray:  # never a view of the mapped checkpoint
        block = stacked_block(leaf, index, dtype, in_our_layout)
        return block.copy() if leaf.names.ndim == 0 else block  # a stacked block is a fresh array already

    return jax.make_array_from_callback(leaf.shape, sharding, owned_block)


def _place_fused(reader: CheckpointReader, leaf: FusedSource, dtype: jnp.dtype, sharding) -> jax.Array:
    """Each device's slice of the fused array, built once on the host (its parts are single tensors)."""
    fused = leaf.fuse([np.asarray(part.from_checkpoint(reader.read(str(part.names))), dtype=dtype)
                       for part in leaf.parts])
    return jax.make_array_from_callback(leaf.shape, sharding, lambda index: fused[index])


def load_kv_scales(reader: CheckpointReader, spec: ModelSpec, kv_head_repeat: int = 1) -> np.ndarray | None:
    """The checkpoint's KV-cache scales as float32 `[layers, 2 (K, V), kv_heads × kv_head_repeat]` (a per-layer
    scalar repeated over the heads), or None when it has none. They stay float32 whatever the model dtype."""
    for template in KV_SCALE_TEMPLATES:
        names = kv_scale_names(spec.num_layers, template)
        present = [name in reader for name in names.flat]
        if not any(present):
            continue
        if not all(present):
            missing = next(name for name, ok in zip(names.flat, present) if not ok)
            raise CheckpointError(f"the checkpoint has KV-cache scales for some layers but no tensor {missing}")
        heads = spec.num_kv_heads
        values = np.stack([_kv_scale(reader, name, heads) for name in names.flat])
        logger.info("KV-cache scales from the checkpoint (%s)", template.format(i="N", kv="k|v"))
        return np.repeat(values.reshape(spec.num_layers, 2, heads), kv_head_repeat, axis=-1)
    return None


def _kv_scale(reader: CheckpointReader, name: str, kv_heads: int) -> np.ndarray:
    tensor = np.asarray(reader.read(name), np.float32).reshape(-1)
    if tensor.size not in (1, kv_heads):
        raise CheckpointError(f"tensor {name} has shape {tuple(reader.shape(name))}; a KV-cache scale is a scalar "
                              f"or one value per KV head ({kv_heads})")
    if not (np.isfinite(tensor).all() and (tensor > 0).all()):
        raise CheckpointError(f"tensor {name} holds {tensor.tolist()}; KV-cache scales must be positive and finite")
    return np.broadcast_to(tensor, (kv_heads,))


def _with_kv_scales(params: dict, spec: ModelSpec, scales: np.ndarray | None, sharding_for: ShardingFor) -> dict:
    """Each layer gets its scales as the float32 parameter `kv_scale [2, kv_heads]`."""
    if scales is None:
        return params
    layers = tuple({**weights, "kv_scale": jax.device_put(scales[i], sharding_for(f"['layers'][{i}]['kv_scale']",
                                                                                 scales[i].shape))}
                   for i, weights in enumerate(params["layers"]))
    return {**params, "layers": layers}
