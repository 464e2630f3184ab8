"""GGUF (llama.cpp) tensor names → HF names, and the q/k row order llama-architecture files carry.

llama.cpp's converter reorders the rows of `q_proj`/`k_proj` of llama-architecture models for GGML's rope, which
rotates adjacent pairs (x0, x1), (x2, x3), ... where HF rotates the two halves of each head (x_i, x_{i + d/2}): within
each head, row (half a, index b) of HF's weight sits at (index b, half a) in the file. `unpermute_heads` undoes it.
Qwen2/Qwen3 files keep HF's order (GGML runs their rope in the halves convention).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTN, _MLP = "self_attn", "mlp"
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": f"{_ATTN}.q_proj.weight", "attn_q.bias": f"{_ATTN}.q_proj.bias",
    "attn_k.weight": f"{_ATTN}.k_proj.weight", "attn_k.bias": f"{_ATTN}.k_proj.bias",
    "attn_v.weight": f"{_ATTN}.v_proj.weight", "attn_v.bias": f"{_ATTN}.v_proj.bias",
    "attn_output.weight": f"{_ATTN}.o_proj.weight", "attn_output.bias": f"{_ATTN}.o_proj.bias",
    "attn_q_norm.weight": f"{_ATTN}.q_norm.weight", "attn_k_norm.weight": f"{_ATTN}.k_norm.weight",
    "ffn_gate.weight": f"{_MLP}.gate_proj.weight", "ffn_up.weight": f"{_MLP}.up_proj.weight",
    "ffn_down.weight": f"{_MLP}.down_proj.weight",
    # Qwen2-MoE's shared expert and its gate (`[hidden]` in the file, HF's `[1, hidden]`: the reader reshapes it)
    "ffn_gate_shexp.weight": f"{_MLP}.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": f"{_MLP}.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": f"{_MLP}.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": f"{_MLP}.shared_expert_gate.weight",
}
# expert stacks [experts, out, in] → one HF tensor per expert; (router, gate, up, down) per MoE naming
_EXPERTS = {
    "qwen": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
             "mlp.experts.{e}.down_proj.weight"),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
}
_EXPERT_PARTS = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# files converted before llama.cpp stacked the experts (many Mixtral ones): one tensor per expert
_ONE_EXPERT = re.compile(r"ffn_(gate|up|down)\.(\d+)\.weight")
IGNORED = ("rope_freqs.weight",)  # read into the config (`config.llama3_rope`), not a parameter
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


class Origin(NamedTuple):
    """Where one HF tensor comes from in the file."""

    tensor: str  # the GGUF tensor name
    expert: int | None = None  # its index along an expert stack
    permuted_heads: int = 0  # > 0: rows reordered for GGML's rope over this many heads (`unpermute_heads`)


def hf_names(gguf_name: str, shape: tuple[int, ...], moe_style: str, heads: tuple[int, int] | None
             ) -> dict[str, Origin]:
    """The HF tensor(s) one GGUF tensor holds (none for an unknown one); `heads` = (query heads, KV heads) for files
    whose q/k rows are permuted (llama architecture), else None."""
    if gguf_name in _GLOBAL:
        return {_GLOBAL[gguf_name]: Origin(gguf_name)}
    match = _BLOCK.fullmatch(gguf_name)
    if match is None:
        return {}
    layer, part = match.groups()
    prefix = f"model.layers.{layer}."
    if part in _LAYER:
        permuted = 0
        if heads is not None and part.startswith(("attn_q.", "attn_k.")):
            permuted = heads[0] if part.startswith("attn_q.") else heads[1]
        return {prefix + _LAYER[part]: Origin(gguf_name, permuted_heads=permuted)}
    if part in _EXPERT_PARTS:
        template = _EXPERTS[moe_style][_EXPERT_PARTS.index(part)]
        if part == "ffn_gate_inp.weight":
            return {prefix + template: Origin(gguf_name)}
        return {prefix + template.format(e=e): Origin(gguf_name, expert=e) for e in range(shape[0])}
    if (one := _ONE_EXPERT.fullmatch(part)) is not None:
        kind, expert = one.groups()
        template = _EXPERTS[moe_style][1 + ("gate", "up", "down").index(kind)]
        return {prefix + template.format(e=int(expert)): Origin(gguf_name)}
    return {}


def unpermute_heads(tensor: np.ndarray, heads: int) -> np.ndarray:
    """HF's row order of a llama.cpp-permuted q/k weight `[heads · head_dim, ...]` (or bias `[heads · head_dim]`)."""
    rows = tensor.shape[0]
    split = tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:])
    return split.swapaxes(1, 2).reshape(tensor.shape)


_PROJECTION = re.compile(r"(model\.layers\.\d+)\.(self_attn|mlp|block_sparse_moe)\.(experts\.(\d+)\.)?"
                         r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
# projections the model runs as one matmul: kept in 8 bits only together
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def int8_modules(types: dict[str, str]) -> set[str]:
    """The HF modules (`model.layers.0.self_attn.q_proj`) of Q8_0 projections whose fused partners are Q8_0 too
    (`types`: HF tensor name → GGUF type name); experts are stacked per projection, so each stack goes alike."""
    sets: dict[tuple, list[tuple[str, str]]] = {}
    for name, type_name in types.items():
        match = _PROJECTION.fullmatch(name)
        if match is None:
            continue
        layer, _, _, expert, proj = match.groups()
        key = (layer, "experts" if expert is not None else _FUSED.get(proj, proj), proj if expert else None)
        sets.setdefault(key, []).append((name.removesuffix(".weight"), type_name))
    return {module for members in sets.values() if all(t == "Q8_0" for _, t in members) for module, _ in members}
