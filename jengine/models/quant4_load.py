"""`quantization_config` of 4-bit checkpoints (AWQ, GPTQ, compressed-tensors W4A16) and a checkpoint reader that
presents their packed modules as float `weight` tensors (`models/quant4.py` unpacks them), so the loader places them
like any float checkpoint where they are not kept packed (`models/quant4_place.py` decides, and logs which). 8-bit methods are not read here (`read_quant4_config` returns None for them)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

import numpy as np

from jengine.errors import CheckpointError, UnsupportedModelError
from jengine.models.checkpoint import CheckpointReader, TensorInfo
from jengine.models.quant_config import check_ct_extras
from jengine.models.quant4 import (
    GPTQ_BITS, Unpacked, _groups, ct_group_rows, gptq_zero_points, unpack_awq, unpack_compressed_tensors,
    unpack_gptq)

logger = logging.getLogger(__name__)

_AWQ_REFUSED = ("gemv", "gemv_fast", "marlin", "exllama", "ipex")


@dataclasses.dataclass(frozen=True)
class Quant4Config:
    method: Literal["awq", "gptq", "compressed-tensors", "gguf"]
    bits: int
    group_size: int  # -1: one group over the whole input (GPTQ); 0: compressed-tensors reads it from the scales
    zeros_one_less: bool = False  # GPTQ v1
    symmetric: bool = True
    group_sizes: tuple[int, ...] = ()  # compressed-tensors: its groups' `group_size`s (a weight's from its scales)

    @property
    def label(self) -> str:
        return f"{self.method} {self.bits}-bit, group {self.group_size}"


def read_quant4_config(hf_config: dict[str, Any]) -> Quant4Config | None:
    """The checkpoint's 4-bit quantization, or None when it has none of these (float, or an 8-bit method)."""
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method in ("awq_marlin", "gptq_marlin", "marlin", "gptq_marlin_24", "exl2"):
        raise UnsupportedModelError(f"quant_method {method!r} is a Marlin/ExLlama-only format and is not supported; "
                                    "jengine reads AWQ (GEMM) and GPTQ checkpoints")
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "compressed-tensors":
        return _compressed_tensors_w4a16(qc)
    return None


def _awq(qc: dict[str, Any]) -> Quant4Config:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedModelError(f"AWQ version {version!r} is not supported (AutoAWQ's 'gemm' format only"
                                    f"{'; ' + version + ' packs for its own kernel' if version in _AWQ_REFUSED else ''})")
    if qc.get("backend") == "llm-awq":
        raise UnsupportedModelError("AWQ backend 'llm-awq' (its own int16 packing) is not supported (AutoAWQ's "
                                    "'gemm' format only)")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise UnsupportedModelError(f"AWQ with {bits} bits is not supported (4 only)")
    if not qc.get("zero_point", True):
        raise UnsupportedModelError("AWQ without zero points (zero_point: false) is not supported")
    return Quant4Config("awq", 4, int(qc.get("group_size", qc.get("q_group_size", 128))), symmetric=False)


def _gptq(qc: dict[str, Any]) -> Quant4Config:
    bits = int(qc.get("bits", 4))
    if bits not in GPTQ_BITS:
        raise UnsupportedModelError(f"GPTQ with {bits} bits is not supported (2, 4 or 8; 3-bit packs across words)")
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise UnsupportedModelError(f"GPTQ pack_dtype {qc['pack_dtype']!r} is not supported (int32 words only)")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt == "marlin" or qc.get("is_marlin_format"):
        raise UnsupportedModelError("Marlin-packed GPTQ checkpoints are not supported (checkpoint_format 'gptq' "
                                    "or 'gptq_v2' only)")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedModelError(f"GPTQ checkpoint_format {fmt!r} is not supported ('gptq' or 'gptq_v2')")
    group_size = int(qc.get("group_size", 128))
    _check_dynamic(qc.get("dynamic") or {}, bits, group_size)
    return Quant4Config("gptq", bits, group_size, zeros_one_less=fmt == "gptq", symmetric=bool(qc.get("sym", True)))


def _check_dynamic(dynamic: dict[str, Any], bits: int, group_size: int) -> None:
    """GPTQModel's per-module overrides (`dynamic`): `-:regex` leaves modules in float (read as such: they have no
    `qweight`); a `+:regex` (or bare regex) that changes bits or group size is refused by name (one layout a
    checkpoint here)."""
    for pattern, override in dynamic.items():
        if pattern.startswith("-:") or not isinstance(override, dict):
            continue
        changed = {k: v for k, v in override.items()
                   if (k == "bits" and int(v) != bits) or (k == "group_size" and int(v) != group_size)}
        if changed:
            raise UnsupportedModelError(f"GPTQ dynamic override {pattern!r} sets {changed}; per-module bits or "
                                        f"group sizes other than the checkpoint's ({bits} bits, group {group_size}) "
                                        "are not supported")


def _compressed_tensors_w4a16(qc: dict[str, Any]) -> Quant4Config | None:
    """Only 4-bit `pack-quantized` weights with float activations; a checkpoint with no 4-bit group is not ours."""
    groups = list((qc.get("config_groups") or {}).values())
    bits = {int((g.get("weights") or {}).get("num_bits", 0)) for g in groups}
    if 4 not in bits:
        return None
    if bits != {4}:
        raise UnsupportedModelError(f"compressed-tensors groups of {sorted(bits)} bits mixed are not supported")
    for group in groups:
        weights, fmt = group["weights"], group.get("format") or qc.get("format")
        if fmt != "pack-quantized":
            raise UnsupportedModelError(f"compressed-tensors 4-bit format {fmt!r} is not supported "
                                        "(pack-quantized only)")
        if group.get("input_activations"):
            raise UnsupportedModelError("compressed-tensors 4-bit weights with quantized activations are not "
                                        "supported (W4A16 only)")
        if weights.get("type", "int") != "int" or weights.get("strategy") not in ("group", "channel"):
            raise UnsupportedModelError(f"compressed-tensors 4-bit {weights.get('type')} weights with strategy "
                                        f"{weights.get('strategy')!r} are not supported (int, group or channel)")
    check_ct_extras(qc)
    symmetric = all(g["weights"].get("symmetric", True) for g in groups)
    sizes = tuple(sorted({int(g["weights"]["group_size"]) for g in groups if g["weights"].get("group_size")}))
    return Quant4Config("compressed-tensors", 4, 0, symmetric=symmetric, group_sizes=sizes)


# per method: the packed tensors of a module, by suffix; the first is the one whose presence marks the module
_PARTS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
}
_OPTIONAL = ("g_idx", "weight_zero_point", "weight_g_idx")


class Quant4Reader:
    """`CheckpointReader`'s interface over a 4-bit checkpoint: each packed module's tensors are replaced by one float32
    `<module>.weight` `[out, in]`, unpacked and dequantized when read; every other tensor reads through."""

    def __init__(self, reader: CheckpointReader, quant: Quant4Config) -> None:
        self._reader, self._quant = reader, quant
        parts = _PARTS[quant.method]
        marker = "." + parts[0]
        self._modules = sorted(n[: -len(marker)] for n in reader.names() if n.endswith(marker))
        if not self._modules:
            raise CheckpointError(f"{reader.model_dir}: quantization_config says {quant.label}, but no tensor is named "
                                  f"*.{parts[0]} (the packed weights that format stores)")
        hidden = {f"{m}.{p}" for m in self._modules for p in parts}
        self._names = sorted([n for n in reader.names() if n not in hidden] + [m + ".weight" for m in self._modules])
        self._module_set = set(self._modules)

    @property
    def quant(self) -> Quant4Config:
        return self._quant

    @property
    def model_dir(self):
        return self._reader.model_dir

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def _module(self, name: str) -> str | None:
        module = name.removesuffix(".weight")
        return module if name.endswith(".weight") and module in self._module_set else None

    def shape(self, name: str) -> tuple[int, ...]:
        module = self._module(name)
        if module is None:
            return self._reader.shape(name)
        return self._out_in(module)

    def _out_in(self, module: str) -> tuple[int, int]:
        r, method = self._reader, self._quant.method
        if method == "compressed-tensors":
            return tuple(int(v) for v in r.read(module + ".weight_shape"))
        scale = r.shape(module + ".scales")
        if method == "awq":
            return scale[1], r.shape(module + ".qweight")[0]
        return scale[1], r.shape(module + ".qweight")[0] * 32 // self._quant.bits

    def dtype(self, name: str) -> np.dtype:
        return np.dtype("<f4") if self._module(name) else self._reader.dtype(name)

    def info(self, name: str) -> TensorInfo:
        module = self._module(name)
        if module is None:
            return self._reader.info(name)
        packed = self._reader.info(f"{module}.{_PARTS[self._quant.method][0]}")
        return dataclasses.replace(packed, dtype=np.dtype("<f4"), shape=self.shape(name))

    def unpacked(self, module: str) -> Unpacked:
        """The module's integer values, zeros, scales and groups (what a W4A16 kernel reads)."""
        r, q = self._reader, self._quant
        get = {p: (r.read(f"{module}.{p}") if f"{module}.{p}" in r else None) for p in _PARTS[q.method]}
        missing = [p for p, v in get.items() if v is None and p not in _OPTIONAL]
        if missing or (q.method == "compressed-tensors" and not q.symmetric and get["weight_zero_point"] is None):
            raise CheckpointError(f"module {module} of {r.model_dir} lacks {', '.join(missing)}")
        if q.method == "awq":
            return unpack_awq(get["qweight"], get["qzeros"], get["scales"], q.group_size)
        if q.method == "gptq":
            return unpack_gptq(get["qweight"], get["qzeros"], get["scales"], get["g_idx"], q.bits, q.group_size,
                               q.zeros_one_less)
        return unpack_compressed_tensors(get["weight_packed"], get["weight_scale"], get["weight_zero_point"],
                                         self._out_in(module), get["weight_g_idx"], q.group_sizes)

    def zero_points(self, module: str) -> np.ndarray:
        """A GPTQ module's zero points `[groups, N]` in the values' unsigned scale (v1's stored ones corrected),
        read without the weight."""
        q = self._quant
        if q.method != "gptq":
            raise ValueError("zero_points reads GPTQ modules")
        return gptq_zero_points(self._reader.read(module + ".qzeros"), q.bits, q.zeros_one_less,
                                self._out_in(module)[0])

    def is_packed(self, module: str) -> bool:
        """Whether the checkpoint stores `module` quantized (a 4-bit checkpoint may keep some projections float)."""
        return module in self._module_set

    def group_rows(self, module: str) -> tuple[np.ndarray, int]:
        """(each input row's group, the number of groups) from the scales' shape and any g_idx, without unpacking
        the weight (what deciding whether a module can stay packed needs)."""
        r, q = self._reader, self._quant
        if q.method == "compressed-tensors":
            k, groups = self._out_in(module)[1], r.shape(module + ".weight_scale")[1]
            stored = r.read(module + ".weight_g_idx") if module + ".weight_g_idx" in r else None
            return ct_group_rows(k, groups, stored, q.group_sizes), groups
        k, groups = self._out_in(module)[1], r.shape(module + ".scales")[0]
        if q.method == "gptq" and module + ".g_idx" in r:
            return np.asarray(r.read(module + ".g_idx"), np.int32), groups
        return _groups(k, q.group_size), groups

    def read(self, name: str) -> np.ndarray:
        module = self._module(name)
        if module is None:
            return self._reader.read(name)
        return self.unpacked(module).dequantize().T

    def config(self) -> dict[str, Any]:
        return self._reader.config()

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> Quant4Reader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
