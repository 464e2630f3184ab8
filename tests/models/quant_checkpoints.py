"""Writers of tiny 8-bit checkpoints in each on-disk format, written from the formats' descriptions with torch (not
with jengine's reader), plus the float32 checkpoint of the same model with the dequantized weights.

Each format: `quantize(w) -> (tensors of one module, dequantized float32 weight)` for a float32 `[out, in]` weight.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
PROJECTION = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight$")
Quantizer = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _int8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(w / scale).clamp(-128, 127).to(torch.int8)


def _block_amax(w: torch.Tensor, block_out: int, block_in: int) -> torch.Tensor:
    """max |w| per block (edge blocks partial): [ceil(out / block_out), ceil(in / block_in)]."""
    out, inp = w.shape
    padded = torch.zeros(math.ceil(out / block_out) * block_out, math.ceil(inp / block_in) * block_in)
    padded[:out, :inp] = w.abs()
    blocks = padded.reshape(padded.shape[0] // block_out, block_out, padded.shape[1] // block_in, block_in)
    return blocks.amax(dim=(1, 3))


def _spread(scale: torch.Tensor, block_out: int, block_in: int, shape) -> torch.Tensor:
    return scale.repeat_interleave(block_out, 0).repeat_interleave(block_in, 1)[: shape[0], : shape[1]]


def fp8_tensor(input_scale: float | None = None) -> Quantizer:
    """quant_method fp8 without blocks (and compressed-tensors' float `tensor` strategy): one scalar scale."""
    def quantize(w):
        scale = (w.abs().max() / FP8_MAX).reshape(())
        q = _fp8(w, scale)
        tensors = {"weight": q, "weight_scale": scale}
        if input_scale is not None:
            tensors["input_scale"] = torch.tensor(input_scale)
        return tensors, q.float() * scale
    return quantize


def fp8_block(block_out: int, block_in: int, scale_name: str = "weight_scale_inv") -> Quantizer:
    """One scale per block_out × block_in block of the [out, in] weight; real weight = weight × scale."""
    def quantize(w):
        scale = _block_amax(w, block_out, block_in) / FP8_MAX
        full = _spread(scale, block_out, block_in, w.shape)
        q = _fp8(w, full)
        return {"weight": q, scale_name: scale}, q.float() * full
    return quantize


def channel(kind: str, scale_dtype=torch.float32) -> Quantizer:
    """compressed-tensors `channel` strategy: weight_scale [out, 1] (in the scale dtype given)."""
    top = FP8_MAX if kind == "float" else 127.0
    def quantize(w):
        scale = (w.abs().amax(dim=1, keepdim=True) / top).to(scale_dtype)
        q = _fp8(w, scale.float()) if kind == "float" else _int8(w, scale.float())
        return {"weight": q, "weight_scale": scale}, q.float() * scale.float()
    return quantize


def int_group(group: int) -> Quantizer:
    """compressed-tensors int `group` strategy: weight_scale [out, in / group]."""
    def quantize(w):
        scale = _block_amax(w, 1, group) / 127.0
        full = _spread(scale, 1, group, w.shape)
        q = _int8(w, full)
        return {"weight": q, "weight_scale": scale}, q.float() * full
    return quantize


def reshaped_scale(inner: Quantizer, shape_of: Callable[[tuple[int, ...]], tuple[int, ...]]) -> Quantizer:
    """`inner` with its weight_scale stored in another shape (ModelOpt's: per channel `[out]`, blocks
    `[out_blocks, 1, in_blocks, 1]`)."""
    def quantize(w):
        tensors, dequantized = inner(w)
        scale = tensors["weight_scale"]
        return {**tensors, "weight_scale": scale.reshape(shape_of(tuple(scale.shape))).contiguous()}, dequantized
    return quantize


def pack8(values: torch.Tensor) -> torch.Tensor:
    """pack-quantized with 8 bits: value + 128 as a byte, four per int32, the first in the low byte."""
    out, inp = values.shape
    stored = torch.zeros(out, math.ceil(inp / 4) * 4, dtype=torch.int64)
    stored[:, :inp] = values.to(torch.int64) + 128
    words = stored.reshape(out, -1, 4)
    packed = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24
    return (packed - ((packed >> 31) << 32)).to(torch.int32)  # the top byte's high bit is the int32's sign


def packed(inner: Quantizer) -> Quantizer:
    """An int8 quantizer's values written as pack-quantized (`weight_packed`, `weight_shape`)."""
    def quantize(w):
        tensors, dequantized = inner(w)
        q = tensors.pop("weight")
        return {**tensors, "weight_packed": pack8(q), "weight_shape": torch.tensor(list(q.shape))}, dequantized
    return quantize


def ct_config(fmt: str, weights: dict, activations: dict | None, ignore=("lm_head",), **group) -> dict:
    """A compressed-tensors quantization_config with one group targeting every Linear."""
    base_w = {"num_bits": 8, "symmetric": True, "dynamic": False, "group_size": None, "block_structure": None}
    acts = None if activations is None else {"num_bits": 8, "symmetric": True, **activations}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**base_w, **weights},
                                          "input_activations": acts, "output_activations": None, **group}},
            "ignore": list(ignore), "kv_cache_scheme": None}


def write_quantized(src: Path, dst: Path, quantization_config: dict, quantize: Quantizer,
                    keep: Callable[[str], bool] = lambda name: False) -> tuple[Path, Path]:
    """`src`'s projections quantized into `dst/quantized` (config with `quantization_config`) and dequantized into
    the float32 `dst/dequantized`; `keep(name)` leaves a projection in float in both."""
    tensors = load_file(src / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if PROJECTION.match(name) and not keep(name):
            module = name.removesuffix(".weight")
            parts, real = quantize(tensor.float())
            quantized.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
            dequantized[name] = real
        else:
            quantized[name] = dequantized[name] = tensor
    config = json.loads((src / "config.json").read_text())
    dirs = dst / "quantized", dst / "dequantized"
    for d, weights, qc in ((dirs[0], quantized, quantization_config), (dirs[1], dequantized, None)):
        d.mkdir(parents=True, exist_ok=True)
        save_file(weights, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps({**config, **({"quantization_config": qc} if qc else {})}))
        for extra in src.iterdir():
            if extra.name not in ("model.safetensors", "config.json"):
                shutil.copy(extra, d / extra.name)
    return dirs
