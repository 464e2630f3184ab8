"""Random quantized weights for `load_format="dummy"` on a quantized config (vLLM benchmarks quantized models this
way): what the loader would place for such a checkpoint, drawn on the devices from config.json alone.

- 4-bit (`quant_method` awq, gptq, compressed-tensors W4A16): dense projections the W4A16 kernel takes and expert
  stacks the grouped-matmul kernels take stay packed (`layers/quant4.py`), by the same shape rules as the loader
  (`models/quant4_place.py`); the others are float, as the loader dequantizes them. Symmetric 8-bit GPTQ in row
  order: int8 with group scales, as `models/gptq8.py` keeps it. Words are uniform random
  nibbles, zero points at their mean (7.5), scales giving the dummy float weights' standard deviation.
- 8-bit (fp8, compressed-tensors 8-bit, `quantization="fp8"` on a float config): every projection the config
  quantizes (`models/quant_config.py`) becomes a `QuantizedWeight` of its scheme, values normal at the dummy
  standard deviation after scaling; static activation scales are set to cover activations up to ±9.

Routers, norms, embeddings and the LM head stay float, as in real checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jengine.errors import UnsupportedModelError
from jengine.layers.quant import FP8, FP8_MAX, INT8_MAX, QuantizedWeight, QuantScheme
from jengine.layers.quant4 import PACK, Int4Experts, Int4Weight
from jengine.models.quant4_load import Quant4Config, read_quant4_config
from jengine.models.quant4_place import (
    EXPERT_LEAVES, PACKED_LEAVES, expert_shape_reason, in_kernel_layout, int4_impl, kernel_group, leaf_modules,
    rows_per_device, shape_reason, split_of, words_impl)
from jengine.models.quant_config import read_quant_config
from jengine.models.quant_load import QUANTIZED_LEAVES, quant8_impl
from jengine.models.weights import Source, leaf_name

logger = logging.getLogger(__name__)

NIBBLE_ZERO, NIBBLE_STD = 7.5, (255 / 12) ** 0.5  # mean and standard deviation of q uniform on 0 … 15
STATIC_INPUT_SCALE = 9 / FP8_MAX  # a static activation scale covering |x| ≤ 9

Maker = Callable[[jax.Array], Any]  # key → the placed leaf


def quantized_makers(config: dict[str, Any], quantization: str | None, flat_sources: list[tuple[str, Source]],
                     sharding_for, shards: int, platform: str, std: float) -> dict[str, Maker]:
    """Leaf path → a maker of its random quantized leaf, for the leaves a checkpoint of this config stores
    quantized and the kernels run so; the rest are drawn as float weights."""
    quant4 = read_quant4_config(config)
    if quant4 is not None:
        if quantization not in (None, quant4.method):
            raise UnsupportedModelError(f"quantization={quantization!r} does not match the config's quant_method "
                                        f"{quant4.method!r}")
        return _int4_makers(quant4, config, flat_sources, sharding_for, shards, platform, std)
    quant8 = read_quant_config(config, quantization)
    if quant8 is None:
        return {}
    impl = quant8_impl(platform)
    makers = {}
    for path, leaf in flat_sources:
        if leaf_name(path) not in QUANTIZED_LEAVES:
            continue
        how = quant8.module(leaf_modules(leaf)[0])
        if how is not None:
            scheme = dataclasses.replace(how.scheme, impl=impl)
            makers[path] = functools.partial(_int8_leaf, path=path, shape=leaf.shape, scheme=scheme,
                                             static_input=how.static_input, sharding_for=sharding_for, std=std)
    logger.info("dummy weights: %d projections in 8 bits (%s)", len(makers), quant8.label)
    return makers


def _int4_makers(quant: Quant4Config, config: dict[str, Any], flat_sources, sharding_for, shards: int,
                 platform: str, std: float) -> dict[str, Maker]:
    if quant.bits == 8:
        return _gptq8_makers(quant, config, flat_sources, sharding_for, platform, std)
    makers, layers = {}, {}
    for path, leaf in flat_sources:
        name = leaf_name(path)
        if name in PACKED_LEAVES:
            k, n = leaf.shape
            group = kernel_group(_group(quant, config, k))
            if shape_reason(k, n, group, shards, name) is None:
                makers[path] = functools.partial(_int4_leaf, path=path, shape=leaf.shape, group=group,
                                                 sharding_for=sharding_for, impl=int4_impl(platform), std=std)
        elif name in EXPERT_LEAVES:
            group = _group(quant, config, leaf.shape[-2])
            fits = expert_shape_reason(group, rows_per_device(sharding_for, path, leaf)) is None
            layers.setdefault(path.rsplit("[", 1)[0], []).append((path, leaf, fits))
    for stacks in layers.values():  # gate and up packed both or neither (one launch), down on its own
        gate_up = all(fits for path, _, fits in stacks if leaf_name(path) != "we_down")
        for path, leaf, fits in stacks:
            if fits if leaf_name(path) == "we_down" else gate_up:
                makers[path] = functools.partial(_int4_experts, path=path, shape=leaf.shape,
                                                 group=_group(quant, config, leaf.shape[-2]),
                                                 sharding_for=sharding_for, std=std)
    logger.info("dummy weights: %d leaves in 4 bits (%s), the rest float", len(makers), quant.label)
    return makers


def _gptq8_makers(quant: Quant4Config, config: dict[str, Any], flat_sources, sharding_for, platform: str,
                  std: float) -> dict[str, Maker]:
    """8-bit GPTQ as the loader keeps it (`models/gptq8.py`): symmetric, rows in order, int8 with group scales."""
    qc = config.get("quantization_config") or {}
    if not quant.symmetric or qc.get("desc_act"):
        logger.info("dummy weights: %s is dequantized by the loader (asymmetric or in activation order); float "
                    "weights instead", quant.label)
        return {}
    impl = quant8_impl(platform)
    makers = {}
    for path, leaf in flat_sources:
        if leaf_name(path) in PACKED_LEAVES + EXPERT_LEAVES and (group := _group(quant, config, leaf.shape[-2])):
            makers[path] = functools.partial(_int8_leaf, path=path, shape=leaf.shape,
                                             scheme=QuantScheme("int8", None, group, 1, impl=impl),
                                             static_input=False, sharding_for=sharding_for, std=std)
    logger.info("dummy weights: %d leaves in 8 bits (%s), the rest float", len(makers), quant.label)
    return makers


def _group(quant: Quant4Config, config: dict[str, Any], k: int) -> int:
    """Input rows per group of a `k`-row projection: the config's group size (all `k` rows where it is larger; 0
    where it leaves a ragged last group, which the kernels do not take); GPTQ's -1 and compressed-tensors' channel
    strategy are one group of all rows."""
    if quant.group_size > 0:
        return k if k <= quant.group_size else quant.group_size if k % quant.group_size == 0 else 0
    if quant.method == "compressed-tensors":
        qc = config.get("quantization_config") or config.get("compression_config")
        weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
        sizes = {int(w["group_size"]) for w in weights if w.get("strategy") == "group" and w.get("group_size")}
        if len(sizes) == 1:
            size = sizes.pop()
            return k if k <= size else size if k % size == 0 else 0
    return k


def _placed(fn, sharding, key, **static):
    """`fn(key, **static)` drawn on the devices where `sharding` puts it. Module-level `fn`s with static arguments:
    alike leaves (every layer's) share one compiled program."""
    return jax.jit(fn, static_argnames=tuple(static), out_shardings=sharding)(key, **static)


def _nibble_words(key, *, shape: tuple[int, ...]):
    return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint32), jnp.int32)


def _filled(key, *, shape: tuple[int, ...], value: float, dtype):
    del key
    return jnp.full(shape, value, dtype)


def _int4_parts(key, path: str, packed_shape, group_shape, sharding_for, std: float):
    packed_sharding = sharding_for(path + ".packed", packed_shape)
    packed = _placed(_nibble_words, packed_sharding, key, shape=packed_shape)
    zeros = _placed(_filled, sharding_for(path + ".zeros", group_shape), key, shape=group_shape, value=NIBBLE_ZERO,
                    dtype=jnp.float16)
    scales = _placed(_filled, sharding_for(path + ".scales", group_shape), key, shape=group_shape,
                     value=std / NIBBLE_STD, dtype=jnp.float16)
    return packed_sharding, packed, zeros, scales


def _int4_leaf(key, *, path: str, shape, group: int, sharding_for, impl: str, std: float) -> Int4Weight:
    k, n = shape
    sharding, packed, zeros, scales = _int4_parts(key, path, (k // PACK, n), (k // group, n), sharding_for, std)
    mesh, split = split_of(sharding)
    weight = Int4Weight(packed, zeros, scales, None, group, words_impl(impl), mesh=mesh if split else None,
                        split=split)
    return in_kernel_layout(weight, impl)


def _int4_experts(key, *, path: str, shape, group: int, sharding_for, std: float) -> Int4Experts:
    e, k, n = shape
    _, packed, zeros, scales = _int4_parts(key, path, (e, k // PACK, n), (e, k // group, n), sharding_for, std)
    return Int4Experts(packed, zeros, scales)


def _int8_draw(key, *, shape: tuple[int, ...], scheme: QuantScheme, std: float) -> QuantizedWeight:
    """Values normal with `spread` standard deviations (int8: up to 4 of them in range), scaled back to `std`."""
    *lead, k, n = shape
    fp8 = scheme.weight_dtype == "fp8"
    spread = 1.0 if fp8 else INT8_MAX / 4
    v = jax.random.normal(key, shape, jnp.float32) * spread
    values = v.astype(FP8) if fp8 else jnp.clip(jnp.round(v), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    scale_shape = (*lead, -(-k // scheme.block_k) if scheme.block_k else 1, -(-n // scheme.block_n))
    return QuantizedWeight.from_kn(values, jnp.full(scale_shape, std / spread, jnp.float32), None, scheme,
                                   keep_kn=bool(lead))


def _int8_leaf(key, *, path: str, shape, scheme: QuantScheme, static_input: bool, sharding_for,
               std: float) -> QuantizedWeight:
    static = dict(shape=tuple(shape), scheme=scheme, std=std)
    abstract = jax.eval_shape(functools.partial(_int8_draw, **static), key)
    shardings = dataclasses.replace(abstract, weight=sharding_for(path + ".weight", abstract.weight.shape),
                                    scale=sharding_for(path + ".scale", abstract.scale.shape))
    weight = _placed(_int8_draw, shardings, key, **static)
    if not static_input:
        return weight
    input_scale = _placed(_filled, sharding_for(path + ".input_scale", ()), key, shape=(), value=STATIC_INPUT_SCALE,
                          dtype=jnp.float32)
    return dataclasses.replace(weight, input_scale=input_scale)
