"""Gated MLPs: the dense one, and the mixture of experts with grouped (ragged) matmuls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jengine.layers.linear import ACTIVATIONS, Precision, linear, split_fused
from jengine.layers.lora import LayerLora
from jengine.models.spec import MoeSpec


def gated_mlp(
    x: Float[Array, "tokens d"], w: dict[str, Array], act: str, precision: Precision = None, shards: int = 1,
    lora: LayerLora | None = None,
) -> Float[Array, "tokens d"]:
    """down(act(gate(x)) * up(x)), with the optional biases some Llama configs ask for; gate and up are one fused
    projection whose columns are grouped per `shards` (see `split_fused`); `lora`: the rows' adapters add to the
    three projections."""
    inter = w["w_down"].shape[0]
    gate_up = linear(x, w["w_gate_up"], w.get("b_gate_up"), precision)
    if lora is not None:
        gate_up = gate_up + lora.delta("gate_up", x, precision)
    gate, up = split_fused(gate_up, (inter, inter), shards)
    hidden = ACTIVATIONS[act](gate) * up
    out = linear(hidden, w["w_down"], w.get("b_down"), precision)
    return out if lora is None else out + lora.delta("down", hidden, precision)


def route(
    x: Float[Array, "tokens d"], router: Float[Array, "d experts"], moe: MoeSpec, precision: Precision = None
) -> tuple[Float[Array, "tokens k"], jax.Array]:
    """Top-k experts per token: softmax in float32 over all experts, then (optionally) renormalised over the k."""
    logits = jnp.dot(x, router, precision=precision).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, moe.num_experts_per_tok)
    if moe.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), experts


def moe_mlp(
    x: Float[Array, "tokens d"], w: dict[str, Array], moe: MoeSpec, act: str, precision: Precision = None
) -> Float[Array, "tokens d"]:
    """Each token's k (token, expert) pairs are sorted by expert and multiplied group by group (`ragged_dot`).

    Work is tokens × k expert MLPs, not tokens × all experts; the weighted sum over the k outputs recombines them.
    """
    tokens, k = x.shape[0], moe.num_experts_per_tok
    weights, experts = route(x, w["router"], moe, precision)
    flat_experts = experts.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    x_sorted = x[order // k]
    group_sizes = jnp.bincount(flat_experts, length=moe.num_experts).astype(jnp.int32)

    def grouped(lhs: Array, rhs: Array) -> Array:
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision)

    hidden = ACTIVATIONS[act](grouped(x_sorted, w["we_gate"])) * grouped(x_sorted, w["we_up"])
    out_sorted = grouped(hidden, w["we_down"])
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(tokens, k, -1)
    return jnp.einsum("tkd,tk->td", out, weights, precision=precision)


def moe_mlp_expert_parallel(
    x: Float[Array, "tokens d"], w: dict[str, Array], moe: MoeSpec, act: str, precision: Precision,
    mesh: jax.sharding.Mesh, axis: str,
) -> Float[Array, "tokens d"]:
    """The MoE with experts split whole over `axis`: every device routes all tokens (the activations are replicated
    under tensor parallelism, so dispatch needs no communication), runs only the (token, expert) pairs of its own
    experts, and one `psum` combines the partial outputs."""
    weights, experts = route(x, w["router"], moe, precision)
    P = jax.sharding.PartitionSpec
    split = P(axis)

    def local(x, weights, experts, we_gate, we_up, we_down):
        tokens, k, num_local = x.shape[0], experts.shape[1], we_gate.shape[0]
        local_expert = experts - jax.lax.axis_index(axis) * num_local
        mine = (local_expert >= 0) & (local_expert < num_local)
        key = jnp.where(mine, local_expert, num_local).reshape(-1)  # other devices' pairs sort to the end
        order = jnp.argsort(key, stable=True)
        group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
        x_sorted = x[order // k]

        def grouped(lhs: Array, rhs: Array) -> Array:
            return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision)

        hidden = ACTIVATIONS[act](grouped(x_sorted, we_gate)) * grouped(x_sorted, we_up)
        out_sorted = jnp.where(mine.reshape(-1)[order][:, None], grouped(hidden, we_down), 0)
        out = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(tokens, k, -1)
        partial = jnp.einsum("tkd,tk->td", out, jnp.where(mine, weights, 0), precision=precision)
        return jax.lax.psum(partial, axis)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), split, split, split), out_specs=P())(
        x, weights, experts, w["we_gate"], w["we_up"], w["we_down"])
