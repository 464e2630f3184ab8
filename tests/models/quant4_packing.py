"""Test-side 4-bit packers, written from each format's documented layout (AutoAWQ GEMM, AutoGPTQ/GPTQModel,
compressed-tensors pack-quantized), and a tiny checkpoint builder that quantizes an HF model's projections."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word takes column AWQ_PACK_ORDER[i]


def _words(fields: np.ndarray, bits: int) -> np.ndarray:
    """[..., 32/bits] unsigned fields → int32 words, field i at bits i·bits."""
    word = np.zeros(fields.shape[:-1], np.uint32)
    for i in range(fields.shape[-1]):
        word |= fields[..., i].astype(np.uint32) << np.uint32(i * bits)
    return word.view(np.int32)


def pack_awq(q: np.ndarray) -> np.ndarray:
    """[rows, N] 4-bit → [rows, N/8] in AWQ's interleaved nibble order."""
    groups = q.reshape(q.shape[0], -1, 8)
    return _words(groups[..., AWQ_PACK_ORDER], 4)


def pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ qweight: [K, N] → [K·bits/32, N], consecutive input rows in one word."""
    per = 32 // bits
    return _words(q.reshape(-1, per, q.shape[1]).transpose(0, 2, 1), bits)


def pack_columns(q: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ qzeros / compressed-tensors weight_packed: [R, C] → [R, C·bits/32], consecutive columns in one word."""
    return _words(q.reshape(q.shape[0], -1, 32 // bits), bits)


def quantize_groups(w_in_out: np.ndarray, group: int, bits: int, symmetric: bool, g_idx: np.ndarray | None = None):
    """Round-to-nearest per (group, column): returns (q [K, N], zeros [G, N], scales [G, N], g_idx [K])."""
    k, n = w_in_out.shape
    g_idx = np.arange(k) // group if g_idx is None else g_idx
    groups = int(g_idx.max()) + 1
    top = (1 << bits) - 1
    scales, zeros = np.zeros((groups, n), np.float32), np.zeros((groups, n), np.int64)
    for g in range(groups):
        rows = w_in_out[g_idx == g]
        if symmetric:
            scales[g] = np.abs(rows).max(0) / ((top + 1) // 2 - 0.5)
            zeros[g] = (top + 1) // 2
        else:
            lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
            scales[g] = (hi - lo) / top
            zeros[g] = np.clip(np.round(-lo / scales[g]), 0, top)
    scales = scales.astype(np.float16).astype(np.float32)
    q = np.clip(np.round(w_in_out / scales[g_idx]) + zeros[g_idx], 0, top).astype(np.int64)
    return q, zeros, scales, g_idx


def dequantized(q, zeros, scales, g_idx) -> np.ndarray:
    return ((q - zeros[g_idx]) * scales[g_idx]).astype(np.float32)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_PROJECTIONS = ("w1", "w2", "w3")  # Mixtral's expert names


def quantize_checkpoint(model_dir: Path, fmt: str, group: int, bits: int = 4, symmetric: bool = False,
                        desc_act: bool = False, v1: bool = False, seed: int = 0):
    """Rewrites `model_dir` (an HF float checkpoint, tensors as saved) in `fmt` (awq, gptq, ct; `group` -1: one
    group over each projection's inputs); returns the HF
    model holding the dequantized weights (saved beside it and loaded by transformers): the exact reference."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(seed)
    state = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(path)))
        path.unlink()
    out, held, orders = {}, {}, {}
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.split(".")[-1] in PROJECTIONS + EXPERT_PROJECTIONS):
            out[name] = held[name] = w
            continue
        w_in_out = w.astype(np.float32).T
        size = group if group > 0 else w_in_out.shape[0]  # -1: one group over every input
        # one activation order per input (a module's parent and its input width), as GPTQ's Hessian is the input's
        key = (module.rsplit(".", 1)[0], w_in_out.shape[0])
        if desc_act and key not in orders:
            orders[key] = rng.permutation(np.arange(w_in_out.shape[0]) // size)
        g_idx = orders.get(key) if desc_act else None
        q, zeros, scales, g_idx = quantize_groups(w_in_out, size, bits, symmetric, g_idx)
        held[name] = dequantized(q, zeros, scales, g_idx).T.copy()
        out.update(_packed(module, fmt, q, zeros, scales, g_idx, bits, v1, symmetric, w.shape))
    reference_dir = model_dir.with_name(model_dir.name + "-dequantized")
    reference_dir.mkdir()
    (reference_dir / "config.json").write_text((model_dir / "config.json").read_text())
    save_file(held, str(reference_dir / "model.safetensors"))
    save_file(out, str(model_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = _quant_config(fmt, group, bits, symmetric, desc_act, v1)
    (model_dir / "config.json").write_text(json.dumps(config))
    return AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _packed(module, fmt, q, zeros, scales, g_idx, bits, v1, symmetric, shape) -> dict[str, np.ndarray]:
    f16 = scales.astype(np.float16)
    if fmt == "awq":
        return {f"{module}.qweight": pack_awq(q), f"{module}.qzeros": pack_awq(zeros), f"{module}.scales": f16}
    if fmt == "gptq":
        stored = zeros - 1 if v1 else zeros
        parts = {f"{module}.qweight": pack_rows(q, bits), f"{module}.scales": f16,
                 f"{module}.qzeros": pack_columns(stored & ((1 << bits) - 1), bits)}
        return parts | {f"{module}.g_idx": g_idx.astype(np.int32)}
    # compressed-tensors: [N, K] signed values + 8 packed along K; zero points (signed + 8) packed along N
    parts = {f"{module}.weight_packed": pack_columns(q.T, 4), f"{module}.weight_scale": f16.T.copy(),
             f"{module}.weight_shape": np.array(shape, np.int64)}
    if symmetric:
        return parts
    return parts | {f"{module}.weight_zero_point": _ct_words(zeros)}


def _ct_words(zeros: np.ndarray) -> np.ndarray:
    """compressed-tensors' zero points: [G, N] (signed + 8) → [N/8, G] words packed along N."""
    return _words(zeros.T.reshape(-1, 8, zeros.shape[0]).transpose(0, 2, 1), 4)


def _quant_config(fmt, group, bits, symmetric, desc_act, v1) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": symmetric,
                "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}},
            "ignore": ["lm_head"]}
