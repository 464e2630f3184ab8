"""The decoder every supported family shares: `forward(params, kv, tokens, metadata) -> (hidden, kv)`.

Families differ only in the spec (biases, q/k norms, sliding windows, dense or MoE MLPs). The layers run as
straight-line code over one weight array per layer (`models/weights.py` says why not a scan over stacked weights);
the KV cache stays one array that every layer updates in place at its own index.

Each layer is a call of one jitted layer function, its index and window passed as traced scalars: alike layers
then share one trace and one lowering (JAX emits one function and a call per layer; XLA inlines the calls, so the
compiled program is the same straight line). Tracing and lowering 32 layers apiece, Pallas kernels included, had
made tracing, not XLA, the bulk of a warm start: about 0.4 s per step program under the GIL on an 8B model.

Each residual add runs inside the RMSNorm after it (`layers/norm.py:add_rms_norm`; one launch, not two, where the
batch-invariant norm is a Pallas kernel): a layer hands the next its MLP output still to be added, so the first
layer, which has none, traces apart from the rest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jengine.attention.backend import AttentionBackend
from jengine.attention.metadata import AttentionMetadata
from jengine.attention.reference import KVCache
from jengine.layers.attention import self_attention
from jengine.layers.invariant import InvariantWeight, invariant_matmul
from jengine.layers.linear import Precision
from jengine.layers.lora import LayerLora, LoraRows, slot_one_hot
from jengine.layers.mlp import gated_mlp, moe_mlp, moe_mlp_expert_parallel, with_shared_expert
from jengine.layers.norm import add_rms_norm, rms_norm
from jengine.layers.rotary import inverse_frequencies
from jengine.models.spec import MlpKind, ModelSpec
from jengine.parallel.mesh import TP_AXIS

Params = dict


def matmul_precision(dtype) -> Precision:
    """float32 models get true float32 matmuls (GPUs default to TF32); lower precisions keep the fast path."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


@functools.partial(jax.jit, static_argnames=("spec", "mlp_kind", "backend", "rope_scaling", "precision",
                                             "expert_mesh"))
def _decoder_layer(
    x: Float[Array, "tokens d"], pending: Float[Array, "tokens d"] | None, kv_cache: KVCache, w: dict[str, Array],
    layer: Int[Array, ""], window: Int[Array, ""], md: AttentionMetadata, inv_freq: Float[Array, " half_rot"],
    lora: LayerLora | None, *, spec: ModelSpec, mlp_kind: MlpKind, backend: AttentionBackend, rope_scaling: float,
    precision: Precision, expert_mesh: jax.sharding.Mesh | None,
) -> tuple[Float[Array, "tokens d"], Float[Array, "tokens d"] | None, KVCache]:
    """One layer on the residual stream `x` plus `pending` (the previous MLP's output, None where already added):
    each residual add runs inside the norm after it, and this layer's MLP output is left pending in turn."""
    eps = spec.rms_norm_eps
    x, h = pending_rms_norm(x, pending, w["attn_norm"], eps)
    attn, kv_cache = self_attention(spec, w, h, kv_cache, layer, window, md, (inv_freq, rope_scaling), backend,
                                    precision, lora)
    x, h = add_rms_norm(x, attn, w["mlp_norm"], eps)
    x, pending = mlp_pending(h, w, md, spec=spec, mlp_kind=mlp_kind, backend=backend, precision=precision,
                             expert_mesh=expert_mesh, lora=lora, residual=x)
    return x, pending, kv_cache


def pending_rms_norm(x: Float[Array, "tokens d"], pending: Float[Array, "tokens d"] | None, weight: Float[Array, " d"],
                     eps: float) -> tuple[Float[Array, "tokens d"], Float[Array, "tokens d"]]:
    """(the residual stream with `pending` added, its RMSNorm): one launch either way."""
    if pending is None:
        return x, rms_norm(x, weight, eps)
    return add_rms_norm(x, pending, weight, eps)


def mlp_block(h: Float[Array, "tokens d"], w: dict[str, Array], md: AttentionMetadata, *, spec: ModelSpec,
              mlp_kind: MlpKind, backend: AttentionBackend, precision: Precision,
              expert_mesh: jax.sharding.Mesh | None, residual: Float[Array, "tokens d"],
              lora: LayerLora | None = None) -> Float[Array, "tokens d"]:
    """`residual` plus a layer's MLP on its normed input `h` (`mlp_pending`'s two parts added)."""
    x, pending = mlp_pending(h, w, md, spec=spec, mlp_kind=mlp_kind, backend=backend, precision=precision,
                             expert_mesh=expert_mesh, residual=residual, lora=lora)
    return x if pending is None else x + pending


def mlp_pending(h: Float[Array, "tokens d"], w: dict[str, Array], md: AttentionMetadata, *, spec: ModelSpec,
                mlp_kind: MlpKind, backend: AttentionBackend, precision: Precision,
                expert_mesh: jax.sharding.Mesh | None, residual: Float[Array, "tokens d"],
                lora: LayerLora | None = None) -> tuple[Float[Array, "tokens d"], Float[Array, "tokens d"] | None]:
    """A layer's MLP on its normed input `h`: dense, MoE, or MoE with the experts split over `expert_mesh`, as
    (the residual stream, the MLP's output still to be added to it). A MoE without a shared expert adds the
    residual inside its experts' last launch where the kernels can (a decode step: one launch fewer a layer), and
    leaves nothing pending (None); elsewhere the add is left to the next norm, which takes it into its launch."""
    kernels, num_tokens = getattr(backend, "experts", None), md.query_start_loc[-1]
    if mlp_kind == "dense":
        return residual, gated_mlp(h, w, spec.hidden_act, precision, spec.projection_shards, lora)
    if expert_mesh is not None:
        routed = moe_mlp_expert_parallel(h, w, spec.moe, spec.hidden_act, precision, expert_mesh, TP_AXIS, kernels,
                                         num_tokens)
    elif kernels is not None and "ws_down" not in w:
        return moe_mlp(h, w, spec.moe, spec.hidden_act, precision, kernels, num_tokens, residual), None
    else:
        routed = moe_mlp(h, w, spec.moe, spec.hidden_act, precision, kernels, num_tokens)
    return residual, with_shared_expert(routed, h, w, spec.hidden_act, precision, spec.projection_shards)


def forward(
    spec: ModelSpec,
    backend: AttentionBackend,
    params: Params,
    kv_cache: KVCache,
    token_ids: Int[Array, " tokens"],
    md: AttentionMetadata,
    expert_mesh: jax.sharding.Mesh | None = None,
    lora_rows: LoraRows | None = None,
) -> tuple[Float[Array, "tokens d"], KVCache]:
    """Runs every layer over a flattened ragged batch; returns the final-normed hidden states and the cache.

    `expert_mesh`: the MoE experts are split whole over its `tp` axis (expert parallelism); without it GSPMD
    partitions everything from the parameter shardings alone. `lora_rows`: the rows' adapter slots, whose
    arrays are `params["lora"][layer]` (`lora/device.py`).
    """
    hidden, kv_cache, _ = forward_capturing(spec, backend, params, kv_cache, token_ids, md, (), expert_mesh,
                                            lora_rows)
    return hidden, kv_cache


def forward_capturing(
    spec: ModelSpec,
    backend: AttentionBackend,
    params: Params,
    kv_cache: KVCache,
    token_ids: Int[Array, " tokens"],
    md: AttentionMetadata,
    capture_layers: tuple[int, ...],
    expert_mesh: jax.sharding.Mesh | None = None,
    lora_rows: LoraRows | None = None,
) -> tuple[Float[Array, "tokens d"], KVCache, list[Float[Array, "tokens d"]]]:
    """`forward`, also returning the residual stream entering each layer of `capture_layers` (in layer order;
    layer 0's input is the embedding), as EAGLE-3 heads read the target's low, middle and high features."""
    precision = matmul_precision(params["embed"].dtype)
    inv_freq, scaling = inverse_frequencies(spec.rope, spec.head_dim)
    x, pending = params["embed"][token_ids], None
    captured = []
    one_hot = None if lora_rows is None else slot_one_hot(lora_rows, _num_lora_slots(params), x.dtype)
    for layer, (w, kind, window) in enumerate(zip(params["layers"], spec.mlp_kinds, spec.layer_windows,
                                                  strict=True)):
        if layer in capture_layers:
            x, pending = x if pending is None else x + pending, None  # the whole stream: the same add, done here
            captured.append(x)
        lora = None if one_hot is None else LayerLora(params["lora"][layer], one_hot)
        x, pending, kv_cache = _decoder_layer(x, pending, kv_cache, w, np.int32(layer), np.int32(window), md,
                                              inv_freq, lora, spec=spec, mlp_kind=kind, backend=backend,
                                              rope_scaling=float(scaling), precision=precision,
                                              expert_mesh=expert_mesh)
    _, hidden = pending_rms_norm(x, pending, params["final_norm"], spec.rms_norm_eps)
    return hidden, kv_cache, captured


def _num_lora_slots(params: Params) -> int:
    """The slot count, from the stacked B arrays' leading axis (`lora/device.py`)."""
    return next(v.shape[0] for k, v in params["lora"][0].items() if k.endswith("_b"))


def compute_logits(spec: ModelSpec, params: Params, hidden: Float[Array, "n d"]) -> Float[Array, "n vocab"]:
    """Logits in float32 at the given rows only (the positions that sample); tied models reuse the embedding."""
    head = params.get("lm_head")
    if isinstance(head, InvariantWeight):  # `--deterministic` (tied models' too: it wraps the embedding)
        return invariant_matmul(hidden, head, matmul_precision(head.dtype), out_dtype=jnp.float32)
    head = params["embed"] if spec.tie_word_embeddings else head
    precision = matmul_precision(head.dtype)
    return jnp.einsum("nd,vd->nv", hidden, head, precision=precision, preferred_element_type=jnp.float32)
