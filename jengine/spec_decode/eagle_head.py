"""The math of an EAGLE head: one decoder layer over (token embedding, feature), chained on its own output.

EAGLE(-2): the feature is the target's final-normed hidden state; `fc [2·d → d]` maps concat(embedding, feature)
into one decoder layer whose input norm is skipped (as the published heads were trained); the layer's output is
both the next feature and, through the target's LM head, the next token's logits.

EAGLE-3: the target's feature is the inputs of three of its layers side by side, fused by `fc [3·d → d]` (the
head's own output, fed back, needs no fusing). The layer ("midlayer") norms the embedding (`input_layernorm`) and the
feature (`hidden_norm`) apart and attends over both (q/k/v take 2·d inputs); its output residual is the next
feature, its final `norm` then `lm_head` give logits over a reduced vocabulary whose ids map to the target's by
`draft_to_target` (the checkpoint's `d2t` offsets plus the draft id).

Position convention (vLLM's): the head's entry at position q is made of token q + 1 and the feature of position q,
so its K/V cache lives at the target's positions, in the target's blocks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jengine.attention.backend import AttentionBackend
from jengine.attention.kv_cache import KVCache
from jengine.attention.metadata import AttentionMetadata
from jengine.layers.attention import self_attention
from jengine.layers.linear import linear
from jengine.layers.norm import rms_norm
from jengine.layers.rotary import inverse_frequencies
from jengine.models.decoder import matmul_precision, mlp_block
from jengine.models.spec import ModelSpec
from jengine.spec_decode.chain import one_token_metadata

EagleKind = Literal["eagle", "eagle3"]


@dataclasses.dataclass(frozen=True)
class HeadModel:
    """What the head's programs are specialised to (a static argument)."""

    spec: ModelSpec  # the head's one decoder layer
    backend: AttentionBackend
    kind: EagleKind
    norm_before_residual: bool = False  # EAGLE-3 variants whose residual is the normed feature


def fuse_features(model: HeadModel, params: dict, captured: Float[Array, "tokens c"]) -> Float[Array, "tokens d"]:
    """The target's captured hidden states as the head's features (EAGLE-3 fuses its three layers)."""
    if model.kind == "eagle":
        return captured
    return linear(captured, params["fc"], params.get("fc_bias"), matmul_precision(params["fc"].dtype))


def head_forward(model: HeadModel, params: dict, kv: KVCache, token_ids: Int[Array, " n"],
                 features: Float[Array, "n d"], md: AttentionMetadata
                 ) -> tuple[Float[Array, "n d"], Float[Array, "n d"], KVCache]:
    """(the hidden states the logits read, the features fed back, the cache with these positions written)."""
    spec, w = model.spec, params["layer"]
    eps = spec.rms_norm_eps
    precision = matmul_precision(params["embed"].dtype)
    embeds = params["embed"][token_ids]
    if model.kind == "eagle":
        x = linear(jnp.concatenate([embeds, features], axis=-1), params["fc"], params.get("fc_bias"), precision)
        attention_input, residual = x, x
    else:
        normed = rms_norm(features, w["hidden_norm"], eps)
        residual = normed if model.norm_before_residual else features
        attention_input = jnp.concatenate([rms_norm(embeds, w["attn_norm"], eps), normed], axis=-1)
    inv_freq, scaling = inverse_frequencies(spec.rope, spec.head_dim)
    attn, kv = self_attention(spec, w, attention_input, kv, np.int32(0), np.int32(spec.layer_windows[0]), md,
                              (inv_freq, float(scaling)), model.backend, precision)
    x = residual + attn
    x = mlp_block(rms_norm(x, w["mlp_norm"], eps), w, md, spec=spec, mlp_kind=spec.mlp_kinds[0],
                  backend=model.backend, precision=precision, expert_mesh=None, residual=x)
    if model.kind == "eagle":
        return x, x, kv
    return rms_norm(x, params["norm"], eps), x, kv


def greedy_tokens(model: HeadModel, params: dict, hidden: Float[Array, "n d"]) -> Int[Array, " n"]:
    """The head's argmax token, as a target id."""
    head = params["lm_head"]
    logits = jnp.einsum("nd,vd->nv", hidden, head, precision=matmul_precision(head.dtype),
                        preferred_element_type=jnp.float32)
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return params["draft_to_target"][best] if "draft_to_target" in params else best


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("kv",))
def observe_step(model: HeadModel, params: dict, kv: KVCache, carry: Float[Array, "rows d"],
                 captured: Float[Array, "tokens c"], token_ids: Int[Array, " tokens"], source: Int[Array, " tokens"],
                 from_carry: Bool[Array, " tokens"], carry_rows: Int[Array, " tokens"], md: AttentionMetadata
                 ) -> tuple[KVCache, Float[Array, "tokens d"]]:
    """The head's K/V for a target step's positions (head token i: the target token at `source[i] + 1` paired
    with the feature of `source[i]`, or with its row's carried feature where the pair straddles two steps);
    returns the step's features for later carries."""
    features = fuse_features(model, params, captured)
    paired = jnp.where(from_carry[:, None], carry[carry_rows], features[jnp.maximum(source, 0)])
    _, _, kv = head_forward(model, params, kv, token_ids, paired, md)
    return kv, features


@functools.partial(jax.jit, donate_argnames=("carry",))
def commit_carry(carry: Float[Array, "rows d"], features: Float[Array, "tokens d"], rows: Int[Array, " n"],
                 source: Int[Array, " n"]) -> Float[Array, "rows d"]:
    """Each of `rows` keeps the feature of its last computed position (rows out of range: padding)."""
    return carry.at[rows].set(features[source], mode="drop")


@functools.partial(jax.jit, static_argnames=("model", "num_drafts", "block_size", "num_slots"),
                   donate_argnames=("kv",))
def propose_chain(model: HeadModel, params: dict, kv: KVCache, carry: Float[Array, "rows d"],
                  first_tokens: Int[Array, " n"], carry_rows: Int[Array, " n"], positions: Int[Array, " n"],
                  block_tables: Int[Array, "n w"], num_valid: Int[Array, ""], num_drafts: int, block_size: int,
                  num_slots: int) -> tuple[KVCache, Int[Array, "n k"]]:
    """`num_drafts` greedy head steps per row: step j pairs the latest token with the latest feature (first the
    row's newest token and its carried target feature, then each draft and the head's own output)."""
    tokens, features, drafts = first_tokens, carry[carry_rows], []
    for j in range(num_drafts):
        md = one_token_metadata(positions + j, block_tables, num_valid, block_size, num_slots)
        hidden, features, kv = head_forward(model, params, kv, tokens, features, md)
        tokens = greedy_tokens(model, params, hidden)
        drafts.append(tokens)
    return kv, jnp.stack(drafts, axis=1)
