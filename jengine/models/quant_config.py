"""`quantization_config` of config.json → which projections are 8-bit, in which on-disk layout, with which scheme.

Read by the names real checkpoints use:
- `quant_method: "fp8"` (Qwen3-*-FP8, DeepSeek-V3, AutoFP8): float8 e4m3 weights; with `weight_block_size: [128,
  128]` one `weight_scale_inv` per 128 × 128 block of the `[out, in]` weight (the real weight is `weight ×
  weight_scale_inv` despite the name) and activations quantized per token and 128-group in the step; without it one
  `weight_scale` per tensor and `activation_scheme` `dynamic` (per token) or `static` (`input_scale`). Which
  projections are float8 is read from the tensors themselves (routers and `lm_head` stay in bfloat16);
  `ignored_layers` / `modules_to_not_convert` are checked against them.
- `quant_method: "compressed-tensors"` (llm-compressor): each `config_groups` entry's `targets` (a class name such as
  `Linear`, an exact module name, or `re:` + a regex matched from the start of the name) minus `ignore`, with the
  group's `weights` / `input_activations`, stored by `format`: `float-quantized`, `int-quantized` and
  `naive-quantized` (`weight` in 8 bits + `weight_scale`, `input_scale` when static) and `pack-quantized` with 8
  bits (`weight_packed`: four int8 values per int32, little-endian, each stored + 128; `weight_scale`,
  `weight_shape`). A float8 `kv_cache_scheme` is read as the `k_scale` / `v_scale` tensors it wrote
  (`check_kv_cache_scheme`).
- `quant_method: "modelopt"` (NVIDIA Model Optimizer; settings in config.json or its `hf_quant_config.json`), by
  `quant_algo`: `FP8` (per-tensor `weight_scale` and static `input_scale`), `FP8_PER_CHANNEL_PER_TOKEN` (per-channel
  weights, dynamic per-token activations), `FP8_PB_WO` (128 × 128 block scales stored `[out_blocks, 1, in_blocks,
  1]`, activations quantized per token and 128-group); which projections are float8 is read from the tensors, as
  for `fp8`. Its float8 KV cache's scales are the `k_proj.k_scale` / `v_proj.v_scale` tensors.
- `--quantization fp8` on a float checkpoint: every projection quantized at load, per output feature, activations
  per token.
Every other method or setting is refused by name.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from jengine.errors import UnsupportedModelError
from jengine.layers.quant import QuantScheme

Storage = Literal["fp8", "int8", "packed8", "float"]  # float: quantized at load
CT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
QUANTIZATION_CHOICES = ("fp8", "compressed-tensors", "modelopt")


@dataclasses.dataclass(frozen=True)
class ModuleQuant:
    """One checkpoint module's storage and scheme (its `impl` set by the loader for the platform)."""

    storage: Storage
    scheme: QuantScheme
    scale_name: str = "weight_scale"
    block_out_in: tuple[int, int] | None = None  # the checkpoint's scale block on its [out, in] weight
    static_input: bool = False  # the activations' scale is the checkpoint's `input_scale`


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    method: Literal["fp8", "compressed-tensors", "modelopt", "fp8-at-load"]
    groups: tuple[tuple[tuple[str, ...], ModuleQuant], ...]  # (targets, how) in config order
    ignore: tuple[str, ...]
    from_tensors: bool  # fp8 method: a module is quantized iff its tensor is float8 (routers, lm_head stay float)

    def module(self, name: str) -> ModuleQuant | None:
        """How module `name` (e.g. `model.layers.0.self_attn.q_proj`) is stored, or None when kept in float. Where
        several groups match, the most specific wins, as compressed-tensors ranks them: the exact name, then a
        `re:` regex, then the `Linear` class (config order among equals)."""
        if any(_matches(name, target) for target in self.ignore):
            return None
        for rank in range(3):
            how = next((how for targets, how in self.groups
                        if any(_matches(name, t) and _rank(t) == rank for t in targets)), None)
            if how is not None:
                return how
        return None

    @property
    def label(self) -> str:
        schemes = sorted({how.scheme.label for _, how in self.groups})
        return f"{self.method} ({', '.join(schemes)})"


def _rank(target: str) -> int:
    return 1 if target.startswith("re:") else 2 if target == "Linear" else 0


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' rule: `re:` regexes match from the start; `Linear` is every projection; else exact."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or target == name


def read_quant_config(hf_config: dict[str, Any], requested: str | None) -> QuantConfig | None:
    """The checkpoint's quantization, `requested` (`--quantization`) checked against it; None for a float model."""
    if requested is not None and requested not in QUANTIZATION_CHOICES:
        raise UnsupportedModelError(f"quantization={requested!r} is not supported; jengine reads "
                                    f"{', '.join(QUANTIZATION_CHOICES)} (8-bit) checkpoints and quantizes a float "
                                    "checkpoint to fp8 at load with quantization='fp8'")
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if not qc:
        if requested == "fp8":
            return QuantConfig("fp8-at-load", ((("Linear",), ModuleQuant("float", QuantScheme("fp8", "fp8"))),),
                               (), from_tensors=False)
        if requested is not None:
            raise UnsupportedModelError(f"quantization={requested!r} needs a checkpoint quantized that way; this "
                                        "one has no quantization_config")
        return None
    method = qc.get("quant_method")
    if requested is not None and requested != method:
        raise UnsupportedModelError(f"quantization={requested!r} does not match the checkpoint's quant_method "
                                    f"{method!r}")
    if method == "fp8":
        return _fp8_method(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "modelopt":
        return _modelopt(qc)
    raise UnsupportedModelError(f"quant_method {method!r} is not supported; jengine reads 8-bit 'fp8', "
                                "'compressed-tensors' and 'modelopt' checkpoints")


def _fp8_method(qc: dict[str, Any]) -> QuantConfig:
    acts = qc.get("activation_scheme", "dynamic")
    if acts not in ("dynamic", "static"):
        raise UnsupportedModelError(f"fp8 activation_scheme {acts!r} is not supported (dynamic or static)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedModelError(f"fp8 fmt {qc['fmt']!r} is not supported (float8 e4m3 only)")
    block = qc.get("weight_block_size")
    ignore = tuple(qc.get("ignored_layers") or ()) + tuple(qc.get("modules_to_not_convert") or ())
    if block is None:
        how = ModuleQuant("fp8", QuantScheme("fp8", "fp8"), static_input=acts == "static")
    else:
        if acts != "dynamic" or not (isinstance(block, list) and len(block) == 2 and all(
                isinstance(b, int) and b > 0 for b in block)):
            raise UnsupportedModelError(f"fp8 weight_block_size {block!r} with activation_scheme {acts!r} is not "
                                        "supported (two positive sizes, dynamic activations)")
        out_block, in_block = block
        how = ModuleQuant("fp8", QuantScheme("fp8", "fp8", block_k=in_block, block_n=out_block, act_group=in_block),
                          scale_name="weight_scale_inv", block_out_in=(out_block, in_block))
    return QuantConfig("fp8", ((("Linear",), how),), ignore, from_tensors=True)


def _modelopt(qc: dict[str, Any]) -> QuantConfig:
    """ModelOpt's float8 algorithms (`hf_quant_config.json` nests them under `quantization`; config.json does not)."""
    nested = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(nested.get("quant_algo") or "").upper()
    kv = nested.get("kv_cache_quant_algo")
    if kv is not None and str(kv).upper() != "FP8":
        raise UnsupportedModelError(f"ModelOpt kv_cache_quant_algo {kv!r} is not supported (FP8: "
                                    "kv_cache_dtype='fp8')")
    check_kv_cache_scheme(nested.get("kv_cache_scheme"))
    fp8 = QuantScheme("fp8", "fp8")
    if algo == "FP8":
        how = ModuleQuant("fp8", fp8, static_input=True)
    elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
        how = ModuleQuant("fp8", fp8)
    elif algo == "FP8_PB_WO":
        how = ModuleQuant("fp8", QuantScheme("fp8", "fp8", block_k=128, block_n=128, act_group=128),
                          block_out_in=(128, 128))
    else:
        raise UnsupportedModelError(f"ModelOpt quant_algo {algo or None!r} is not supported; jengine reads FP8, "
                                    "FP8_PER_CHANNEL_PER_TOKEN and FP8_PB_WO")
    return QuantConfig("modelopt", ((("Linear",), how),), (), from_tensors=True)


def _compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    status = qc.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):  # frozen: quantized values saved as their format says, as compressed
        raise UnsupportedModelError(f"compressed-tensors quantization_status {status!r} is not supported (only "
                                    "'compressed' and 'frozen' checkpoints are read)")
    check_ct_extras(qc)
    groups = []
    for name, group in (qc.get("config_groups") or {}).items():
        if not isinstance(group, dict):
            raise UnsupportedModelError(f"compressed-tensors config group {name!r} is {group!r}, not a scheme")
        fmt = group.get("format") or qc.get("format")
        if fmt not in CT_FORMATS:
            raise UnsupportedModelError(f"compressed-tensors format {fmt!r} (config group {name!r}) is not "
                                        f"supported; jengine reads {', '.join(CT_FORMATS)} with 8 bits")
        targets = group.get("targets") or []
        if isinstance(targets, str):
            targets = [targets]
        groups.append((tuple(targets), _ct_group(name, fmt, group)))
    if not groups:
        raise UnsupportedModelError("compressed-tensors quantization_config has no config_groups")
    return QuantConfig("compressed-tensors", tuple(groups), tuple(qc.get("ignore") or ()), from_tensors=False)


def check_ct_extras(qc: dict[str, Any]) -> None:
    """What a compressed-tensors config carries besides its groups: the KV cache's scheme, sparsity (only `dense`,
    plain tensors) and transforms (none: a Hadamard-rotated model run without its rotations would be wrong)."""
    check_kv_cache_scheme(qc.get("kv_cache_scheme"))
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise UnsupportedModelError(f"compressed-tensors sparsity_config of format {sparsity['format']!r} is not "
                                    "supported (dense only)")
    if qc.get("transform_config"):
        raise UnsupportedModelError("compressed-tensors transform_config (online rotations such as SpinQuant or "
                                    "QuIP) is not supported")


def check_kv_cache_scheme(scheme: dict[str, Any] | None) -> None:
    """llm-compressor's float8 KV cache (`kv_cache_scheme`): its `k_scale` / `v_scale` tensors, one per layer
    (`tensor`) or per KV head (`attn_head`), are what the loader reads for `kv_cache_dtype="fp8"` (a `dynamic`
    scheme stores none: the first prefill calibrates them). Any other cache is refused by name."""
    if not scheme:
        return
    kind, bits, strategy = scheme.get("type", "float"), scheme.get("num_bits"), scheme.get("strategy", "tensor")
    if kind != "float" or bits != 8:
        raise UnsupportedModelError(f"compressed-tensors kv_cache_scheme of {bits}-bit {kind} values is not "
                                    "supported (8-bit float: kv_cache_dtype='fp8')")
    if strategy not in ("tensor", "attn_head") or not scheme.get("symmetric", True):
        raise UnsupportedModelError(f"compressed-tensors kv_cache_scheme with strategy {strategy!r} "
                                    f"(symmetric: {scheme.get('symmetric', True)}) is not supported (symmetric, "
                                    "per tensor or per attention head)")


def _ct_group(name: str, fmt: str, group: dict[str, Any]) -> ModuleQuant:
    w, a = group.get("weights") or {}, group.get("input_activations")
    where = f"compressed-tensors config group {name!r}"
    kind = w.get("type", "int")
    if w.get("num_bits") != 8 or kind not in ("float", "int"):
        raise UnsupportedModelError(f"{where}: {w.get('num_bits')}-bit {kind} weights are not supported (8 bits)")
    if not w.get("symmetric", True) or w.get("dynamic"):
        raise UnsupportedModelError(f"{where}: asymmetric or dynamic weights are not supported")
    if group.get("output_activations"):
        raise UnsupportedModelError(f"{where}: output_activations quantization is not supported")
    if w.get("actorder") == "group":  # its groups follow a stored weight_g_idx, which the 8-bit path does not read
        raise UnsupportedModelError(f"{where}: 8-bit weights with actorder 'group' are not supported")
    if fmt == "pack-quantized" and kind != "int":
        raise UnsupportedModelError(f"{where}: pack-quantized holds int weights")
    block_k, block_n = _weight_blocks(where, w)
    acts, act_group = _activations(where, a, kind)
    if fmt == "pack-quantized" and acts is not None:
        raise UnsupportedModelError(f"{where}: pack-quantized with quantized activations is not supported")
    if act_group and (act_group != block_k or block_n == 1):
        raise UnsupportedModelError(f"{where}: group-wise activations of {act_group} need block weights of "
                                    f"{act_group} input features")
    scheme = QuantScheme("fp8" if kind == "float" else "int8", acts, block_k, block_n, act_group)
    storage: Storage = "packed8" if fmt == "pack-quantized" else scheme.weight_dtype
    static = a is not None and a.get("dynamic", False) is False
    return ModuleQuant(storage, scheme, block_out_in=(block_n, block_k) if block_k else None, static_input=static)


def _weight_blocks(where: str, w: dict[str, Any]) -> tuple[int, int]:
    strategy = w.get("strategy", "tensor")
    if strategy in ("tensor", "channel"):
        return 0, 1
    if strategy == "group" and isinstance(w.get("group_size"), int) and w["group_size"] > 0:
        return w["group_size"], 1
    block = w.get("block_structure")
    if strategy == "block" and isinstance(block, list) and len(block) == 2:
        return block[1], block[0]
    raise UnsupportedModelError(f"{where}: weight strategy {strategy!r} is not supported (tensor, channel, group "
                                "with group_size, block with block_structure)")


def _activations(where: str, a: dict[str, Any] | None, weight_kind: str) -> tuple[str | None, int]:
    if a is None:
        return None, 0
    kind, strategy, dynamic = a.get("type", "int"), a.get("strategy", "tensor"), a.get("dynamic", False)
    if a.get("num_bits") != 8 or kind != weight_kind or not a.get("symmetric", True):
        raise UnsupportedModelError(f"{where}: input activations of {a.get('num_bits')}-bit {kind} are not supported "
                                    "with these weights (8-bit, symmetric, the weights' type)")
    if strategy == "token" and dynamic is True:
        return ("fp8" if kind == "float" else "int8"), 0
    if strategy == "tensor" and dynamic is False:
        return ("fp8" if kind == "float" else "int8"), 0
    if strategy == "group" and dynamic is True and isinstance(a.get("group_size"), int):
        return ("fp8" if kind == "float" else "int8"), a["group_size"]
    raise UnsupportedModelError(f"{where}: input activations with strategy {strategy!r} and dynamic={dynamic!r} "
                                "are not supported (dynamic per token or group, or a static per-tensor scale)")
