"""Where each parameter comes from in an HF checkpoint: our pytree paths → HF tensor names, shapes, transposes.

Our layout: projections `[in, out]` (HF stores `[out, in]`), one array per layer and weight (`params["layers"][i]`),
a layer's experts stacked along a leading axis. q/k/v are one fused projection `wqkv`, gate/up one `w_gate_up`
(`FusedSource`): one matmul where there were three or two, which at small batches are kernel launches and partial
waves more than bytes. Their columns are grouped per tensor-parallel shard, so a split of the fused axis over the
devices hands each its own heads' q, k and v (and its own slice of gate and up) with no communication.

Why not one array per weight stacked over the layers, run by `lax.scan`: on GPUs XLA copies each layer's slice out of
the stack before the matmul reads it, which tripled a memory-bound decode step's weight traffic (H200, 32 Llama-3-8B
layers at batch 1: 10.7 ms scanned vs 3.7 ms with separate arrays; `scripts/probe_layer_loop_gpu.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from jengine.models.spec import ModelSpec

_ATTN = "model.layers.{i}.self_attn"


@dataclasses.dataclass(frozen=True)
class LeafSource:
    """One parameter array: `names` has the stack shape (none, or experts); each is one HF tensor."""

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


@dataclasses.dataclass(frozen=True)
class FusedSource:
    """Several projections side by side along the output axis, grouped per shard: shard s holds its slice of
    part 0, then its slice of part 1, and so on (`split_fused` undoes it)."""

    parts: tuple[LeafSource, ...]
    shards: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.parts[0].shape[:-1] + (sum(p.shape[-1] for p in self.parts),)

    def fuse(self, tensors: list[np.ndarray], axis: int = -1) -> np.ndarray:
        """The parts (each in our layout) → the fused array. `axis=0` fuses the parts in the checkpoint's layout
        ([out, in]: the same grouping along the rows, the fused array transposed)."""
        pieces = [np.split(t, self.shards, axis=axis) for t in tensors]
        return np.concatenate([piece[s] for s in range(self.shards) for piece in pieces], axis=axis)


def stacked_block(leaf: LeafSource, index: tuple[slice, ...], dtype, read: Callable[[str], np.ndarray]
                  ) -> np.ndarray:
    """One device's block (`index`) of a leaf: its stacking axes select tensor names, the rest slices each tensor
    as `read(name)` returns it, cast to `dtype`."""
    stack_rank = leaf.names.ndim
    stack_index, tensor_index = index[:stack_rank], index[stack_rank:]
    if not stack_rank:
        return np.asarray(read(str(leaf.names))[tensor_index], dtype=dtype)
    names = leaf.names[stack_index]
    pieces = [np.asarray(read(name)[tensor_index], dtype=dtype) for name in names.flat]
    return np.stack(pieces).reshape(names.shape + pieces[0].shape)


Source = LeafSource | FusedSource


def is_source(x) -> bool:
    return isinstance(x, (LeafSource, FusedSource))


def leaf_name(path: str) -> str:
    """The last key of a source tree path (`['layers'][0]['wo']` → `wo`)."""
    return path.rsplit("['", 1)[-1].rstrip("']")


def _one(layer: int, template: str, shape: tuple[int, ...], transpose: bool) -> LeafSource:
    return LeafSource(np.array(template.format(i=layer), dtype=object), shape, transpose)


def _experts(layer: int, template: str, experts: int, shape: tuple[int, ...]) -> LeafSource:
    names = np.array([template.format(i=layer, e=e) for e in range(experts)], dtype=object)
    return LeafSource(names, shape, True)


def _attention_leaves(spec: ModelSpec, layer: int, kv_repeat: int, shards: int) -> dict[str, Source]:
    d, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_heads * hd, spec.num_kv_heads * hd * kv_repeat
    one = functools.partial(_one, layer)

    def kv_leaf(template: str, shape: tuple[int, ...], transpose: bool) -> LeafSource:
        return dataclasses.replace(one(template, shape, transpose), head_repeat=kv_repeat, head_dim=hd)

    leaves: dict[str, Source] = {
        "attn_norm": one("model.layers.{i}.input_layernorm.weight", (d,), False),
        "mlp_norm": one("model.layers.{i}.post_attention_layernorm.weight", (d,), False),
        "wqkv": FusedSource((one(_ATTN + ".q_proj.weight", (d, q_out), True),
                             kv_leaf(_ATTN + ".k_proj.weight", (d, kv_out), True),
                             kv_leaf(_ATTN + ".v_proj.weight", (d, kv_out), True)), shards),
        "wo": one(_ATTN + ".o_proj.weight", (q_out, d), True),
    }
    if spec.qkv_bias:
        leaves["bqkv"] = FusedSource((one(_ATTN + ".q_proj.bias", (q_out,), False),
                                      kv_leaf(_ATTN + ".k_proj.bias", (kv_out,), False),
                                      kv_leaf(_ATTN + ".v_proj.bias", (kv_out,), False)), shards)
    if spec.o_bias:
        leaves["bo"] = one(_ATTN + ".o_proj.bias", (d,), False)
    if spec.qk_norm:
        leaves["q_norm"] = one(_ATTN + ".q_norm.weight", (hd,), False)
        leaves["k_norm"] = one(_ATTN + ".k_norm.weight", (hd,), False)
    return leaves


def _dense_mlp_leaves(spec: ModelSpec, layer: int, shards: int) -> dict[str, Source]:
    d, inter = spec.hidden_size, spec.intermediate_size
    one = functools.partial(_one, layer)
    base = "model.layers.{i}.mlp"
    leaves: dict[str, Source] = {
        "w_gate_up": FusedSource((one(base + ".gate_proj.weight", (d, inter), True),
                                  one(base + ".up_proj.weight", (d, inter), True)), shards),
        "w_down": one(base + ".down_proj.weight", (inter, d), True),
    }
    if spec.mlp_bias:
        leaves["b_gate_up"] = FusedSource((one(base + ".gate_proj.bias", (inter,), False),
                                           one(base + ".up_proj.bias", (inter,), False)), shards)
        leaves["b_down"] = one(base + ".down_proj.bias", (d,), False)
    return leaves


def _moe_leaves(spec: ModelSpec, layer: int, shards: int) -> dict[str, Source]:
    moe = spec.moe
    d, inter, experts = spec.hidden_size, moe.intermediate_size, moe.num_experts
    if moe.weight_style == "mixtral":
        base, gate, up, down = "model.layers.{i}.block_sparse_moe", "w1", "w3", "w2"
    else:
        base, gate, up, down = "model.layers.{i}.mlp", "gate_proj", "up_proj", "down_proj"
    expert = base + ".experts.{e}."
    leaves: dict[str, Source] = {
        "router": _one(layer, base + ".gate.weight", (d, experts), True),
        "we_gate": _experts(layer, expert + gate + ".weight", experts, (d, inter)),
        "we_up": _experts(layer, expert + up + ".weight", experts, (d, inter)),
        "we_down": _experts(layer, expert + down + ".weight", experts, (inter, d)),
    }
    if shared := moe.shared_intermediate_size:  # Qwen2-MoE's shared expert: a dense MLP and its [1, d] gate
        one, own = functools.partial(_one, layer), base + ".shared_expert."
        leaves["ws_gate_up"] = FusedSource((one(own + "gate_proj.weight", (d, shared), True),
                                            one(own + "up_proj.weight", (d, shared), True)), shards)
        leaves["ws_down"] = one(own + "down_proj.weight", (shared, d), True)
        leaves["ws_gate"] = one(base + ".shared_expert_gate.weight", (d, 1), True)
    return leaves


EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def parameter_sources(spec: ModelSpec, kv_repeat: int = 1, shards: int = 1) -> dict:
    """The full parameter pytree of `spec`, with a source at every leaf; `kv_repeat` repeats each KV head;
    `shards`: the tensor-parallel size the fused projections group their columns for."""
    layers = []
    for layer, kind in enumerate(spec.mlp_kinds):
        mlp = _moe_leaves(spec, layer, shards) if kind == "moe" else _dense_mlp_leaves(spec, layer, shards)
        layers.append(_attention_leaves(spec, layer, kv_repeat, shards) | mlp)
    d, vocab = spec.hidden_size, spec.vocab_size
    tree = {
        "embed": LeafSource(np.array(EMBEDDING, dtype=object), (vocab, d), False),
        "final_norm": LeafSource(np.array("model.norm.weight", dtype=object), (d,), False),
        "layers": tuple(layers),
    }
    if not spec.tie_word_embeddings:
        tree["lm_head"] = LeafSource(np.array(LM_HEAD, dtype=object), (vocab, d), False)
    return tree


# KV-cache scales of checkpoints made for a float8 KV cache (real value = stored value × scale): a scalar per layer or
# one value per KV head, K then V, in the spellings such checkpoints use (the third: older llm-compressor output, the
# scale of the k/v projections' outputs; the fourth: ModelOpt's).
KV_SCALE_TEMPLATES = (_ATTN + ".{kv}_scale", _ATTN + ".attn.{kv}_scale", _ATTN + ".{kv}_proj.output_scale",
                      _ATTN + ".{kv}_proj.{kv}_scale")


def kv_scale_names(num_layers: int, template: str) -> np.ndarray:
    """`[layers, 2]` HF tensor names (K, V) in one spelling of `KV_SCALE_TEMPLATES`."""
    return np.array([[template.format(i=i, kv=kv) for kv in "kv"] for i in range(num_layers)], dtype=object)
