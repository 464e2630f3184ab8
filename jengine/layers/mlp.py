"""Gated MLPs: the dense one, and the mixture of experts with grouped matmuls.

The experts' grouped products run either as XLA's `ragged_dot` (the reference path: exact on the CPU) or, on
NVIDIA GPUs, as the Pallas grouped-matmul kernels of `pallas_kernels.grouped_matmul` (`PallasExperts`). On the GPU
XLA lowers `ragged_dot` to a dense product over every expert — 13.6× the bytes floor at batch 1 and out of memory
at a 4,096-token budget — while the kernels read each routed expert's weights once and never an unrouted one.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from jengine.layers.invariant import (InvariantWeight, RowReduction, invariant_log_softmax, on_every_device,
                                     ordered_sum)
from jengine.layers.linear import ACTIVATIONS, Precision, linear, split_fused
from jengine.layers.lora import LayerLora
from jengine.layers.experts import expert_float, expert_operands, kernel_weight_specs, kernel_weights
from jengine.models.spec import MoeSpec
from jengine.parallel.collectives import ordered_psum

if TYPE_CHECKING:  # Pallas imported only where used
    from pallas_kernels.grouped_matmul.router import ChosenExperts


def gated_mlp(
    x: Float[Array, "tokens d"], w: dict[str, Array], act: str, precision: Precision = None, shards: int = 1,
    lora: LayerLora | None = None,
) -> Float[Array, "tokens d"]:
    """down(act(gate(x)) * up(x)), with the optional biases some Llama configs ask for; gate and up are one fused
    projection whose columns are grouped per `shards` (see `split_fused`); `lora`: the rows' adapters add to the
    three projections."""
    inter = w["w_down"].shape[0]
    if lora is None:
        gate_up = linear(x, w["w_gate_up"], w.get("b_gate_up"), precision)
    else:
        gate_up = lora.project("gate_up", x, w["w_gate_up"], w.get("b_gate_up"), precision)
    gate, up = split_fused(gate_up, (inter, inter), shards)
    hidden = ACTIVATIONS[act](gate) * up
    if lora is None:
        return linear(hidden, w["w_down"], w.get("b_down"), precision)
    return lora.project("down", hidden, w["w_down"], w.get("b_down"), precision)


class Routing(NamedTuple):
    """Each token's k routing weights and expert ids (-1 for the bucket's padding tokens); `chosen`: the distinct
    experts chosen, where the fused router lists them (`PallasExperts.list_chosen`)."""

    weights: Float[Array, "tokens k"]
    experts: Int[Array, "tokens k"]
    chosen: ChosenExperts | None = None


def route(
    x: Float[Array, "tokens d"], router: Float[Array, "d experts"], moe: MoeSpec, precision: Precision = None,
    kernels: PallasExperts | None = None, num_tokens: Int[Array, ""] | None = None,
) -> Routing:
    """Top-k experts per token: softmax in float32 over all experts, then (optionally) renormalised over the k; in
    one kernel where `kernels` can (`PallasExperts.top_k`). `num_tokens`: the real tokens of the step; the rest is
    bucket padding, routed nowhere."""
    logits = linear(x, router, precision=precision).astype(jnp.float32)
    if kernels is not None and kernels.fuses_top_k(router, x.shape[0]):
        return kernels.top_k(logits, moe, num_tokens, x.dtype)
    if isinstance(router, InvariantWeight) and router.impl != "xla":
        probs = jnp.exp(invariant_log_softmax(logits, RowReduction(router.impl, router.mesh)))
    else:
        probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, moe.num_experts_per_tok)
    if moe.norm_topk_prob:  # k adds in one order (an XLA reduction's order may follow the row count)
        weights = weights / ordered_sum(weights)[:, None]
    return Routing(weights.astype(x.dtype), skip_padding(experts, num_tokens))


@dataclasses.dataclass(frozen=True)
class PallasExperts:
    """The experts as the Pallas grouped-matmul kernels (hashable: part of the step's static model). The kernels
    are per-device code: under tensor parallelism (experts split by their hidden features) each device runs its
    slice of every expert and one `psum` adds the partial outputs, as the dense MLP's row-parallel down does."""

    interpret: bool = False  # CPU tests run the same kernels in Pallas interpret mode
    mesh: jax.sharding.Mesh | None = None
    # The router's softmax, top-k and renormalisation as one Pallas launch for steps of at most this many tokens (one
    # program; 0: never); above, XLA's ops are faster (`pallas_kernels/grouped_matmul/router.py` has the figures).
    fused_router_max_tokens: int = 16  # one program: `pallas_kernels.grouped_matmul.router.BLOCK_TOKENS`
    # The fused router also lists the distinct experts chosen, so the by-token launches read them instead of each
    # program comparing every choice with every expert, which held 168 registers a thread. In the engine's decode
    # step on an H100 (12 Qwen3-30B-A3B layers, CUPTI; `scripts/probe_layer_loop_gpu.py --engine-variant`) the
    # expert launches took 36.6 against 46.5 us a layer at batch 1 (down's K steps of 128 included), 140.9
    # against 151.2 at batch 16; the router's listing costs 2.4 of that back.
    list_chosen: bool = True
    # Steps of at least this many tokens run the experts through the Mosaic GPU (TMA, wgmma) grouped matmuls
    # (`pallas_kernels/grouped_matmul/mosaic.py`, Hopper only; float experts whose shapes fit its tiles); 0: never.
    # The GPU backend sets it (`jengine.attention.pallas.MOSAIC_EXPERTS_MIN_TOKENS`, where it measured faster).
    mosaic_min_tokens: int = 0

    def __call__(self, x, w: dict[str, Array], experts, weights, act: str, precision: Precision,
                 chosen: ChosenExperts | None = None, residual: Float[Array, "tokens d"] | None = None):
        """With a batch-invariant router (`--deterministic`), one tile configuration serves every step size, so a
        token's expert sums never change with the bucket (the decode tiles: their K steps are the fixed order).
        `residual`: added to the output (on one device inside the kernels' last launch; under tensor parallelism
        after the partial outputs' sum)."""
        from pallas_kernels.grouped_matmul import moe_experts  # Pallas imported only where used
        from pallas_kernels.grouped_matmul.moe import tile_configs

        invariant = isinstance(w.get("router"), InvariantWeight)
        fixed = tile_configs(0, 1, jnp.dtype(x.dtype).itemsize) if invariant else None
        shards = 1 if self.mesh is None else self.mesh.size
        operands = expert_operands(w, x.dtype, shards)

        mosaic_tiles = self.mosaic_tiles(x.shape[0], invariant)

        def local(x, experts, weights, chosen, stacks, residual=None):
            return moe_experts(x, stacks, experts, weights, act=ACTIVATIONS[act], precision=precision,
                               interpret=self.interpret, configs=fixed, scale_block=operands.scale_block,
                               chosen=chosen, residual=residual, mosaic_tiles=mosaic_tiles)

        if shards == 1:
            return local(x, experts, weights, chosen, kernel_weights(operands), residual)
        axis = self.mesh.axis_names[0]
        add = ordered_psum if invariant else jax.lax.psum  # device order, not the collective library's
        partial = jax.shard_map(lambda *a: add(local(*a), axis), mesh=self.mesh,
                                in_specs=(P(), P(), P(), P(), kernel_weight_specs(operands, axis)), out_specs=P(),
                                check_vma=False)
        out = partial(x, experts, weights, chosen, kernel_weights(operands))
        return out if residual is None else residual + out

    def mosaic_tiles(self, tokens: int, invariant: bool):
        """The Mosaic GPU kernels' tiles for a step of `tokens` (None: the Triton kernels). Not under
        `--deterministic`, whose one tile configuration for every step size keeps a token's sums the same."""
        if invariant or not self.mosaic_min_tokens or tokens < self.mosaic_min_tokens:
            return None
        from pallas_kernels.grouped_matmul.mosaic import DEFAULT_TILES

        return DEFAULT_TILES

    def fuses_top_k(self, router, tokens: int) -> bool:
        """The router's softmax, top-k and renormalisation as one launch for steps of up to
        `fused_router_max_tokens`, except with a batch-invariant router (`--deterministic`), whose softmax has its
        own kernel."""
        return tokens <= self.fused_router_max_tokens and not isinstance(router, InvariantWeight)

    def top_k(self, logits: Float[Array, "tokens experts"], moe: MoeSpec, num_tokens: Int[Array, ""] | None = None,
              dtype=jnp.float32) -> Routing:
        """Each token's routing, its weights in `dtype`, on every device of the mesh alike (the logits are
        replicated); padding tokens (from `num_tokens` on) routed nowhere."""
        from pallas_kernels.grouped_matmul.router import top_k_routing, top_k_routing_listed

        fn = top_k_routing_listed if self.list_chosen else top_k_routing
        real = jnp.int32(logits.shape[0]) if num_tokens is None else num_tokens
        return Routing(*on_every_device(lambda l, n: fn(l, moe.num_experts_per_tok, moe.norm_topk_prob,
                                                         interpret=self.interpret, num_tokens=n, weights_dtype=dtype),
                                        self.mesh, logits, real))


def skip_padding(experts: Int[Array, "tokens k"], num_tokens: Int[Array, ""] | None) -> Int[Array, "tokens k"]:
    """Routes the step's padding tokens nowhere (expert -1), so the kernels read no expert for them."""
    if num_tokens is None:
        return experts
    return jnp.where(jnp.arange(experts.shape[0])[:, None] < num_tokens, experts, -1)


def shared_expert(x: Float[Array, "tokens d"], w: dict[str, Array], act: str, precision: Precision,
                  shards: int) -> Float[Array, "tokens d"]:
    """Qwen2-MoE's shared expert: a gated MLP every token passes through, scaled by sigmoid(x · shared_expert_gate);
    its gate/up columns grouped per shard as the dense MLP's."""
    gate = jax.nn.sigmoid(linear(x, w["ws_gate"], precision=precision))
    return gated_mlp(x, {"w_gate_up": w["ws_gate_up"], "w_down": w["ws_down"]}, act, precision, shards) * gate


def with_shared_expert(routed: Float[Array, "tokens d"], x: Float[Array, "tokens d"], w: dict[str, Array], act: str,
                       precision: Precision, shards: int) -> Float[Array, "tokens d"]:
    """The routed experts' output plus the shared expert's, where the layer has one."""
    return routed if "ws_down" not in w else routed + shared_expert(x, w, act, precision, shards)


def moe_mlp(
    x: Float[Array, "tokens d"], w: dict[str, Array], moe: MoeSpec, act: str, precision: Precision = None,
    kernels: PallasExperts | None = None, num_tokens: Int[Array, ""] | None = None,
    residual: Float[Array, "tokens d"] | None = None,
) -> Float[Array, "tokens d"]:
    """Each token's k (token, expert) pairs are multiplied expert by expert: by `kernels` where given, else sorted
    by expert for `ragged_dot`. Work is tokens × k expert MLPs, not tokens × all experts; the weighted sum over the
    k outputs recombines them. `num_tokens`: the real tokens of the step (the rest is bucket padding). `residual`:
    the layer's residual stream, added to the output (by the kernels' combine where they can)."""
    weights, experts, chosen = route(x, w["router"], moe, precision, kernels, num_tokens)
    if kernels is not None:
        return kernels(x, w, experts, weights, act, precision, chosen, residual)
    out = _ragged_experts(x, weights, experts, (w["we_gate"], w["we_up"], w["we_down"]), act, precision)
    return out if residual is None else residual + out


def moe_mlp_expert_parallel(
    x: Float[Array, "tokens d"], w: dict[str, Array], moe: MoeSpec, act: str, precision: Precision,
    mesh: jax.sharding.Mesh, axis: str, kernels: PallasExperts | None = None,
    num_tokens: Int[Array, ""] | None = None,
) -> Float[Array, "tokens d"]:
    """The MoE with experts split whole over `axis`: every device routes all tokens (the activations are replicated
    under tensor parallelism, so dispatch needs no communication), runs only the (token, expert) pairs of its own
    experts, and one `psum` combines the partial outputs. With `kernels`, each device's kernels skip the pairs of
    other devices' experts (their ids fall outside its local range)."""
    weights, experts, _ = route(x, w["router"], moe, precision, num_tokens=num_tokens)
    split = P(axis)
    add = ordered_psum if isinstance(w["router"], InvariantWeight) else jax.lax.psum  # `--deterministic`

    def local(x, weights, experts, we_gate, we_up, we_down):
        local_expert = experts - jax.lax.axis_index(axis) * we_gate.shape[0]
        if kernels is not None:
            local_w = {"we_gate": we_gate, "we_up": we_up, "we_down": we_down}
            single = dataclasses.replace(kernels, mesh=None)
            return add(single(x, local_w, local_expert, weights, act, precision), axis)
        return add(_ragged_experts(x, weights, local_expert, (we_gate, we_up, we_down), act, precision), axis)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), split, split, split), out_specs=P(),
                         check_vma=False)(x, weights, experts, w["we_gate"], w["we_up"], w["we_down"])


def _ragged_experts(x, weights, local_expert, we: tuple[Array, Array, Array], act: str, precision: Precision):
    """The experts `we` by `ragged_dot` over pairs sorted by expert; pairs of experts outside `we` (another
    device's, under expert parallelism) sort to the end and contribute nothing."""
    we_gate, we_up, we_down = we
    tokens, k, num_local = x.shape[0], local_expert.shape[1], we_gate.shape[0]
    mine = (local_expert >= 0) & (local_expert < num_local)
    key = jnp.where(mine, local_expert, num_local).reshape(-1)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    x_sorted = x[order // k]

    def grouped(lhs: Array, rhs: Array) -> Array:
        return jax.lax.ragged_dot(lhs, expert_float(rhs, lhs.dtype), group_sizes, precision=precision)

    hidden = ACTIVATIONS[act](grouped(x_sorted, we_gate)) * grouped(x_sorted, we_up)
    out_sorted = jnp.where(mine.reshape(-1)[order][:, None], grouped(hidden, we_down), 0)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(tokens, k, -1)
    return jnp.einsum("tkd,tk->td", out, jnp.where(mine, weights, 0), precision=precision)
