"""Where each parameter comes from in an HF checkpoint: our pytree paths → HF tensor names, shapes, transposes.

Our layout: projections `[in, out]` (HF stores `[out, in]`), per-layer weights stacked along a leading axis per run
of alike layers (see `ModelSpec.layer_segments`), experts stacked along a second axis.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jengine.models.spec import ModelSpec

_ATTN = "model.layers.{i}.self_attn"


@dataclasses.dataclass(frozen=True)
class LeafSource:
    """One parameter array: `names` has the stack shape (layers, or layers × experts); each is one HF tensor."""

    names: np.ndarray  # object array of HF tensor names, shape = the stacking axes
    tensor_shape: tuple[int, ...]  # our shape of one tensor (after the transpose and any head repeat)
    transpose: bool  # HF [out, in] → our [in, out]
    # K/V projections when tensor parallelism exceeds the KV heads: each head's features repeated this many times
    # along the last axis, so every device holds (a copy of) the one KV head its query heads use
    head_repeat: int = 1
    head_dim: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.names.shape) + self.tensor_shape

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        """The shape the HF tensor must have."""
        ours = self.tensor_shape[:-1] + (self.tensor_shape[-1] // self.head_repeat,)
        return ours[::-1] if self.transpose else ours

    def from_checkpoint(self, tensor: np.ndarray) -> np.ndarray:
        """One HF tensor in our layout: transposed, heads repeated."""
        if self.transpose:
            tensor = tensor.T
        if self.head_repeat > 1:
            heads = tensor.reshape(tensor.shape[:-1] + (-1, self.head_dim))
            tensor = np.repeat(heads, self.head_repeat, axis=-2).reshape(self.tensor_shape)
        return tensor


def _stack(template: str, layers: range, shape: tuple[int, ...], transpose: bool) -> LeafSource:
    names = np.array([template.format(i=i) for i in layers], dtype=object)
    return LeafSource(names, shape, transpose)


def _expert_stack(template: str, layers: range, experts: int, shape: tuple[int, ...]) -> LeafSource:
    names = np.array([[template.format(i=i, e=e) for e in range(experts)] for i in layers], dtype=object)
    return LeafSource(names, shape, True)


def _attention_leaves(spec: ModelSpec, layers: range, kv_repeat: int) -> dict[str, LeafSource]:
    d, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_heads * hd, spec.num_kv_heads * hd * kv_repeat

    def kv_leaf(template: str, shape: tuple[int, ...], transpose: bool) -> LeafSource:
        return dataclasses.replace(_stack(template, layers, shape, transpose), head_repeat=kv_repeat, head_dim=hd)

    leaves = {
        "attn_norm": _stack("model.layers.{i}.input_layernorm.weight", layers, (d,), False),
        "mlp_norm": _stack("model.layers.{i}.post_attention_layernorm.weight", layers, (d,), False),
        "wq": _stack(_ATTN + ".q_proj.weight", layers, (d, q_out), True),
        "wk": kv_leaf(_ATTN + ".k_proj.weight", (d, kv_out), True),
        "wv": kv_leaf(_ATTN + ".v_proj.weight", (d, kv_out), True),
        "wo": _stack(_ATTN + ".o_proj.weight", layers, (q_out, d), True),
    }
    if spec.qkv_bias:
        leaves["bq"] = _stack(_ATTN + ".q_proj.bias", layers, (q_out,), False)
        leaves["bk"] = kv_leaf(_ATTN + ".k_proj.bias", (kv_out,), False)
        leaves["bv"] = kv_leaf(_ATTN + ".v_proj.bias", (kv_out,), False)
    if spec.o_bias:
        leaves["bo"] = _stack(_ATTN + ".o_proj.bias", layers, (d,), False)
    if spec.qk_norm:
        leaves["q_norm"] = _stack(_ATTN + ".q_norm.weight", layers, (hd,), False)
        leaves["k_norm"] = _stack(_ATTN + ".k_norm.weight", layers, (hd,), False)
    return leaves


def _dense_mlp_leaves(spec: ModelSpec, layers: range) -> dict[str, LeafSource]:
    d, inter = spec.hidden_size, spec.intermediate_size
    base = "model.layers.{i}.mlp"
    leaves = {
        "w_gate": _stack(base + ".gate_proj.weight", layers, (d, inter), True),
        "w_up": _stack(base + ".up_proj.weight", layers, (d, inter), True),
        "w_down": _stack(base + ".down_proj.weight", layers, (inter, d), True),
    }
    if spec.mlp_bias:
        leaves["b_gate"] = _stack(base + ".gate_proj.bias", layers, (inter,), False)
        leaves["b_up"] = _stack(base + ".up_proj.bias", layers, (inter,), False)
        leaves["b_down"] = _stack(base + ".down_proj.bias", layers, (d,), False)
    return leaves


def _moe_leaves(spec: ModelSpec, layers: range) -> dict[str, LeafSource]:
    moe = spec.moe
    d, inter, experts = spec.hidden_size, moe.intermediate_size, moe.num_experts
    if moe.weight_style == "mixtral":
        base, gate, up, down = "model.layers.{i}.block_sparse_moe", "w1", "w3", "w2"
    else:
        base, gate, up, down = "model.layers.{i}.mlp", "gate_proj", "up_proj", "down_proj"
    expert = base + ".experts.{e}."
    return {
        "router": _stack(base + ".gate.weight", layers, (d, experts), True),
        "we_gate": _expert_stack(expert + gate + ".weight", layers, experts, (d, inter)),
        "we_up": _expert_stack(expert + up + ".weight", layers, experts, (d, inter)),
        "we_down": _expert_stack(expert + down + ".weight", layers, experts, (inter, d)),
    }


def parameter_sources(spec: ModelSpec, kv_repeat: int = 1) -> dict:
    """The full parameter pytree of `spec`, with a `LeafSource` at every leaf; `kv_repeat` repeats each KV head."""
    segments = []
    for start, count, kind in spec.layer_segments():
        layers = range(start, start + count)
        mlp = _moe_leaves(spec, layers) if kind == "moe" else _dense_mlp_leaves(spec, layers)
        segments.append(_attention_leaves(spec, layers, kv_repeat) | mlp)
    d, vocab = spec.hidden_size, spec.vocab_size
    tree = {
        "embed": LeafSource(np.array("model.embed_tokens.weight", dtype=object), (vocab, d), False),
        "final_norm": LeafSource(np.array("model.norm.weight", dtype=object), (d,), False),
        "segments": tuple(segments),
    }
    if not spec.tie_word_embeddings:
        tree["lm_head"] = LeafSource(np.array("lm_head.weight", dtype=object), (vocab, d), False)
    return tree


# KV-cache scales of checkpoints made for a float8 KV cache (real value = stored value × scale): a scalar per layer or
# one value per KV head, K then V, in the two spellings such checkpoints use.
KV_SCALE_TEMPLATES = (_ATTN + ".{kv}_scale", _ATTN + ".attn.{kv}_scale")


def kv_scale_names(num_layers: int, template: str) -> np.ndarray:
    """`[layers, 2]` HF tensor names (K, V) in one spelling of `KV_SCALE_TEMPLATES`."""
    return np.array([[template.format(i=i, kv=kv) for kv in "kv"] for i in range(num_layers)], dtype=object)
