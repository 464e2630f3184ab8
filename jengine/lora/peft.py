"""PEFT LoRA adapter directories (`adapter_config.json` + `adapter_model.safetensors`) read into host arrays.

An adapter adds `scale · B(A x)` to a projection, `scale = lora_alpha / r` (rsLoRA: `lora_alpha / √r`). Each
module's pair is kept as `A [in, r]` and `B [r, out]` in float32 with the scale folded into B, per layer and per
projection (q, k, v, o, gate, up, down). Adapters trained on fused projections (`qkv_proj`, `gate_up_proj`) are split
into their parts here (the parts share A). Options that change the math in ways the engine does not compute (DoRA,
`modules_to_save`, embedding or LM-head adapters, LoRA biases) are refused by name, never ignored. Host-only: numpy.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from jengine.errors import AdapterError, CheckpointError
from jengine.models.checkpoint import TensorInfo, parse_safetensors_header
from jengine.models.spec import ModelSpec

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MODULES = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION_MODULES = ("q", "k", "v", "o")
# PEFT module name → the parts it covers (fused checkpoints train one pair over several of our projections)
_TARGETS = {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",), "qkv_proj": ("q", "k", "v"),
            "gate_proj": ("gate",), "up_proj": ("up",), "down_proj": ("down",), "gate_up_proj": ("gate", "up")}
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_REFUSED_OPTIONS = {  # config key → (value that asks for nothing, what it is)
    "use_dora": (False, "DoRA (use_dora)"),
    "modules_to_save": (None, "modules_to_save (fully trained modules)"),
    "fan_in_fan_out": (False, "fan_in_fan_out (Conv1D layouts)"),
    "lora_bias": (False, "lora_bias"),
    "alpha_pattern": ({}, "alpha_pattern (per-module alphas)"),
    "layer_replication": (None, "layer_replication"),
    "trainable_token_indices": (None, "trainable_token_indices"),
}
_EMBEDDING_TARGETS = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out")

ModulePair = tuple[np.ndarray, np.ndarray]  # A [in, r], scale · B [r, out], float32


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One adapter on the host: `layers[i][module]` for the modules it targets in layer i."""

    name: str
    path: str
    rank: int  # the largest rank over its modules
    layers: tuple[dict[str, ModulePair], ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection an adapter may target."""
    d, hd = spec.hidden_size, spec.head_dim
    q, kv, inter = spec.num_heads * hd, spec.num_kv_heads * hd, spec.intermediate_size
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, inter), "up": (d, inter),
            "down": (inter, d)}


def read_adapter(name: str, path: str | Path, spec: ModelSpec, max_rank: int) -> LoraAdapter:
    """Reads and checks an adapter directory against the base model; AdapterError says what is wrong."""
    directory = Path(path)
    config = _read_config(directory)
    _refuse_options(config, directory)
    tensors = _read_tensors(directory / WEIGHTS_FILE)
    pairs = _pairs(tensors, directory)
    layers: list[dict[str, ModulePair]] = [{} for _ in range(spec.num_layers)]
    shapes = module_shapes(spec)
    for (layer, target), (a, b) in sorted(pairs.items()):
        _check_layer(layer, target, spec, directory)
        rank = a.shape[0]
        if rank > max_rank:
            raise AdapterError(f"adapter {name!r} has rank {rank} (layer {layer} {target}), over max_lora_rank="
                               f"{max_rank}; restart with a larger --max-lora-rank")
        scale = _scale(config, rank)
        parts = _TARGETS[target]
        expected_out = [shapes[p][1] for p in parts]
        _check_shapes(a, b, shapes[parts[0]][0], sum(expected_out), layer, target, directory)
        outs = np.split(b.astype(np.float32) * scale, np.cumsum(expected_out)[:-1], axis=0)
        for part, b_part in zip(parts, outs, strict=True):
            layers[layer][part] = (np.ascontiguousarray(a.astype(np.float32).T), np.ascontiguousarray(b_part.T))
    if not pairs:
        raise AdapterError(f"{directory / WEIGHTS_FILE} holds no LoRA weights of q/k/v/o/gate/up/down projections")
    rank = max(a.shape[1] for layer in layers for a, _ in layer.values())
    return LoraAdapter(name, str(directory), rank, tuple(layers))


def _read_config(directory: Path) -> dict:
    if not directory.is_dir():
        raise AdapterError(f"LoRA adapter directory not found: {directory}")
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"{directory} has no {CONFIG_FILE} (a PEFT adapter directory is expected)") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"cannot read {directory / CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{directory / CONFIG_FILE} must hold a JSON object")
    return config


def _refuse_options(config: dict, directory: Path) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{directory}: peft_type {peft_type} is not supported (LoRA adapters only)")
    for key, (inactive, what) in _REFUSED_OPTIONS.items():
        value = config.get(key, inactive)
        if value not in (inactive, None, False, {}, []):
            raise AdapterError(f"{directory}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{directory}: bias={config['bias']!r} is not supported (only bias='none')")
    targets = config.get("target_modules") or ()
    targets = [targets] if isinstance(targets, str) else list(targets)
    embedding = [t for t in targets if any(e in t for e in _EMBEDDING_TARGETS)]
    if embedding:
        raise AdapterError(f"{directory}: embedding and LM-head adapters are not supported ({', '.join(embedding)})")


def _scale(config: dict, rank: int) -> float:
    alpha = float(config.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        hint = " (pickled adapter_model.bin files are never loaded)" if path.with_suffix(".bin").exists() else ""
        raise AdapterError(f"{path.parent} has no {WEIGHTS_FILE}{hint}")
    try:
        infos = parse_safetensors_header(path)
        data = np.fromfile(path, dtype=np.uint8)
    except (CheckpointError, OSError) as e:
        raise AdapterError(f"cannot read {path}: {e}") from None
    return {name: _tensor(data, info) for name, info in infos.items()}


def _tensor(data: np.ndarray, info: TensorInfo) -> np.ndarray:
    return data[info.start:info.end].view(info.dtype).reshape(info.shape)


def _pairs(tensors: dict[str, np.ndarray], directory: Path) -> dict[tuple[int, str], ModulePair]:
    """(layer, PEFT module) → (lora_A [r, in], lora_B [out, r]) as stored; any other tensor is refused by name."""
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.search(name)
        if match is None or match.group(2) not in _TARGETS:
            raise AdapterError(f"{directory}: tensor {name!r} is not a LoRA weight of a q/k/v/o/gate/up/down "
                               f"projection (embedding adapters, DoRA magnitudes and modules_to_save are refused)")
        halves.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    pairs = {}
    for key, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{directory}: layer {key[0]} {key[1]} has lora_{''.join(pair)} without its pair")
        pairs[key] = (pair["A"], pair["B"])
    return pairs


def _check_layer(layer: int, target: str, spec: ModelSpec, directory: Path) -> None:
    if layer >= spec.num_layers:
        raise AdapterError(f"{directory}: layer {layer} does not exist (the model has {spec.num_layers})")
    if spec.mlp_kinds[layer] == "moe" and not set(_TARGETS[target]) <= set(ATTENTION_MODULES):
        raise AdapterError(f"{directory}: layer {layer} is a mixture of experts; adapters on its MLP "
                           f"({target}) are not supported")


def _check_shapes(a: np.ndarray, b: np.ndarray, d_in: int, d_out: int, layer: int, target: str,
                  directory: Path) -> None:
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != d_in or b.shape != (d_out, a.shape[0]):
        raise AdapterError(f"{directory}: layer {layer} {target} has lora_A {a.shape} and lora_B {b.shape}; the "
                           f"base model needs [r, {d_in}] and [{d_out}, r]")
