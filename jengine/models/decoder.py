"""The decoder every supported family shares: `forward(params, kv, tokens, metadata) -> (hidden, kv)`.

Families differ only in the spec (biases, q/k norms, sliding windows, dense or MoE MLPs). The layers run as
straight-line code over one weight array per layer (`models/weights.py` says why not a scan over stacked weights);
the KV cache stays one array that every layer updates in place at its own index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jengine.attention.backend import AttentionBackend
from jengine.attention.metadata import AttentionMetadata
from jengine.attention.reference import KVCache
from jengine.layers.attention import self_attention
from jengine.layers.linear import Precision
from jengine.layers.mlp import gated_mlp, moe_mlp, moe_mlp_expert_parallel
from jengine.layers.norm import rms_norm
from jengine.layers.rotary import inverse_frequencies
from jengine.models.spec import MlpKind, ModelSpec
from jengine.parallel.mesh import TP_AXIS

Params = dict


def matmul_precision(dtype) -> Precision:
    """float32 models get true float32 matmuls (GPUs default to TF32); lower precisions keep the fast path."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _decoder_layer(
    spec: ModelSpec, mlp_kind: MlpKind, backend: AttentionBackend, rope, precision: Precision,
    expert_mesh: jax.sharding.Mesh | None, md: AttentionMetadata, x: Float[Array, "tokens d"], kv_cache: KVCache,
    w: dict[str, Array], layer: int, window: int,
) -> tuple[Float[Array, "tokens d"], KVCache]:
    h = rms_norm(x, w["attn_norm"], spec.rms_norm_eps)
    attn, kv_cache = self_attention(spec, w, h, kv_cache, jnp.int32(layer), jnp.int32(window), md, rope, backend,
                                    precision)
    x = x + attn
    h = rms_norm(x, w["mlp_norm"], spec.rms_norm_eps)
    if mlp_kind == "moe" and expert_mesh is not None:
        x = x + moe_mlp_expert_parallel(h, w, spec.moe, spec.hidden_act, precision, expert_mesh, TP_AXIS)
    elif mlp_kind == "moe":
        x = x + moe_mlp(h, w, spec.moe, spec.hidden_act, precision)
    else:
        x = x + gated_mlp(h, w, spec.hidden_act, precision)
    return x, kv_cache


def forward(
    spec: ModelSpec,
    backend: AttentionBackend,
    params: Params,
    kv_cache: KVCache,
    token_ids: Int[Array, " tokens"],
    md: AttentionMetadata,
    expert_mesh: jax.sharding.Mesh | None = None,
) -> tuple[Float[Array, "tokens d"], KVCache]:
    """Runs every layer over a flattened ragged batch; returns the final-normed hidden states and the cache.

    `expert_mesh`: the MoE experts are split whole over its `tp` axis (expert parallelism); without it GSPMD
    partitions everything from the parameter shardings alone.
    """
    precision = matmul_precision(params["embed"].dtype)
    inv_freq, scaling = inverse_frequencies(spec.rope, spec.head_dim)
    rope = (jnp.asarray(inv_freq), scaling)
    x = params["embed"][token_ids]
    for layer, (w, kind, window) in enumerate(zip(params["layers"], spec.mlp_kinds, spec.layer_windows,
                                                  strict=True)):
        x, kv_cache = _decoder_layer(spec, kind, backend, rope, precision, expert_mesh, md, x, kv_cache, w, layer,
                                     window)
    return rms_norm(x, params["final_norm"], spec.rms_norm_eps), kv_cache


def compute_logits(spec: ModelSpec, params: Params, hidden: Float[Array, "n d"]) -> Float[Array, "n vocab"]:
    """Logits in float32 at the given rows only (the positions that sample); tied models reuse the embedding."""
    head = params["embed"] if spec.tie_word_embeddings else params["lm_head"]
    precision = matmul_precision(head.dtype)
    return jnp.einsum("nd,vd->nv", hidden, head, precision=precision, preferred_element_type=jnp.float32)
