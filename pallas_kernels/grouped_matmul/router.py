"""A MoE router's softmax, top-k and renormalisation in one launch (Pallas, Triton backend).

XLA runs the three as separate kernels (the softmax fusion, its TopK kernel, the renormalising division) in every
MoE layer of every step; at decode sizes each is mostly launch and ramp. Here one program takes 16 tokens' logits
whole (every expert of a row in registers), so nothing is written between the steps.

Ties go to the lower expert index, as `lax.top_k`'s do. The outputs are padded to whole blocks of tokens and a
power-of-two k, and sliced.

Each of the k rounds is a chain of dependent reductions, so more warps shorten it: on an H100 under Nsight Compute
(2026-12-06, 16 tokens × 128 experts, top-8; `scripts/probe_moe_decode_gpu.py --ncu --ncu-router`) one warp takes
23.8 µs, 2 14.8, 4 12.8, 8 9.1, 16 8.4; the engine's decode step spent 20.7 µs a layer in the one-warp launch
(`scripts/probe_layer_loop_gpu.py --part engine`), as long as XLA's three ops. At 256 tokens XLA's ops were faster
than the one-warp launch (11.3 against 14.8 µs in a device loop), so the engine fuses only steps of one program
(`PallasExperts.fused_router_max_tokens`); the 16-warp launch takes 8.5 µs at 256 tokens under Nsight Compute,
not yet timed beside XLA's ops.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr
from jaxtyping import Array, Float, Int

from pallas_kernels.addressing import next_pow2

BLOCK_TOKENS = 16
NUM_WARPS = 16  # see the module docstring


def _top_k_kernel(logits_ref, *refs, k: int, normalize: bool, padded: bool, listed: bool):
    """`refs`: (num_tokens if `padded`), weights, experts, (chosen ids and count if `listed`)."""
    refs = list(refs)
    num_tokens_ref = refs.pop(0) if padded else None
    weights_ref, experts_ref, *list_refs = refs
    tokens, num_experts = logits_ref.shape
    width, slots = next_pow2(num_experts), next_pow2(k)
    rows = pl.program_id(0) * BLOCK_TOKENS + jnp.arange(BLOCK_TOKENS, dtype=jnp.int32)
    cols = jnp.arange(width, dtype=jnp.int32)
    real = rows < tokens
    logits = pltr.load(logits_ref.at[jnp.minimum(rows, tokens - 1)[:, None], jnp.minimum(cols, num_experts - 1)[None]],
                       mask=real[:, None] & (cols[None, :] < num_experts), other=-jnp.inf).astype(jnp.float32)
    probs = jnp.exp(logits - jnp.max(logits, axis=1)[:, None])
    probs = probs / jnp.sum(probs, axis=1)[:, None]
    routed = real if num_tokens_ref is None else real & (rows < num_tokens_ref[0])
    slot = jnp.arange(slots, dtype=jnp.int32)[None, :]
    chosen_w = jnp.zeros((BLOCK_TOKENS, slots), jnp.float32)
    chosen_e = jnp.zeros((BLOCK_TOKENS, slots), jnp.int32)
    picked = jnp.zeros((BLOCK_TOKENS, width), jnp.int32)  # 1 where a routed token chose the expert
    for j in range(k):  # k rounds of argmax, each taking the best remaining expert (lowest index among equals)
        best = jnp.max(probs, axis=1)
        index = jnp.min(jnp.where(probs == best[:, None], cols[None, :], width), axis=1)
        chosen_w = jnp.where(slot == j, best[:, None], chosen_w)
        chosen_e = jnp.where(slot == j, index[:, None], chosen_e)
        taken = cols[None, :] == index[:, None]
        probs = jnp.where(taken, -1.0, probs)
        picked = jnp.where(taken & routed[:, None], 1, picked)
    if normalize:
        chosen_w = chosen_w / jnp.sum(chosen_w, axis=1)[:, None]  # slots past k hold 0
    out = (rows[:, None], slot)  # the outputs are padded to whole blocks and slots: every store in bounds
    pltr.store(weights_ref.at[out], chosen_w.astype(weights_ref.dtype))
    pltr.store(experts_ref.at[out], jnp.where(routed[:, None], chosen_e, -1))
    if listed:
        _store_chosen(*list_refs, jnp.max(picked, axis=0), cols)


def _store_chosen(ids_ref, count_ref, chosen, cols) -> None:
    """The experts with `chosen` 1, in id order, then -1; and their count (in every slot of `count_ref`). Each
    expert goes to its own position (the chosen ones first, the rest after them, each in id order): one store of
    every lane, no `[experts, experts]` comparison to gather them."""
    before = jnp.cumsum(chosen, axis=0) - chosen  # chosen experts with a lower id
    count = jnp.sum(chosen)
    position = jnp.where(chosen > 0, before, count + cols - before)
    pltr.store(ids_ref.at[position], jnp.where(chosen > 0, cols, -1))
    pltr.store(count_ref.at[jnp.arange(BLOCK_TOKENS, dtype=jnp.int32)], jnp.full((BLOCK_TOKENS,), count, jnp.int32))


class ChosenExperts(NamedTuple):
    """The distinct experts a step's tokens chose, in id order (-1 past `count`), for the by-token layout's
    launches (`kernel.TokenChoices`), which then need not find them from every choice in each program."""

    ids: Int[Array, " experts"]
    count: Int[Array, " 1"]


def _routing_call(logits, k: int, normalize: bool, interpret: bool, num_warps: int, num_tokens, listed: bool,
                  weights_dtype):
    tokens, num_experts = logits.shape
    if not 0 < k <= num_experts:
        raise ValueError(f"top-{k} routing over {num_experts} experts")
    if listed and tokens > BLOCK_TOKENS:
        raise ValueError(f"the chosen experts are listed for steps of one program ({BLOCK_TOKENS} tokens), "
                         f"not {tokens}")
    blocks = pl.cdiv(tokens, BLOCK_TOKENS)
    padded = (blocks * BLOCK_TOKENS, next_pow2(k))
    out_shape = [jax.ShapeDtypeStruct(padded, weights_dtype), jax.ShapeDtypeStruct(padded, jnp.int32)]
    if listed:
        out_shape += [jax.ShapeDtypeStruct((next_pow2(num_experts),), jnp.int32),
                      jax.ShapeDtypeStruct((BLOCK_TOKENS,), jnp.int32)]
    operands = (logits,) if num_tokens is None else (logits, jnp.asarray(num_tokens, jnp.int32).reshape(1))
    outs = pl.pallas_call(
        functools.partial(_top_k_kernel, k=k, normalize=normalize, padded=num_tokens is not None, listed=listed),
        grid=(blocks,),
        in_specs=[pl.no_block_spec] * len(operands),
        out_specs=[pl.no_block_spec] * len(out_shape),
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="moe_top_k",
    )(*operands)
    weights, experts = outs[0][:tokens, :k], outs[1][:tokens, :k]
    return (weights, experts) if not listed else (weights, experts, ChosenExperts(outs[2][:num_experts], outs[3][:1]))


ROUTING_STATICS = ("k", "normalize", "interpret", "num_warps", "weights_dtype")


@functools.partial(jax.jit, static_argnames=ROUTING_STATICS)
def top_k_routing(logits: Float[Array, "tokens experts"], k: int, normalize: bool, interpret: bool = False,
                  num_warps: int = NUM_WARPS, num_tokens: Int[Array, ""] | None = None, weights_dtype=jnp.float32,
                  ) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"]]:
    """(the k largest softmax probabilities of each row, renormalised to sum to 1 where `normalize`, rounded once to
    `weights_dtype` (the activations', so no conversion launch follows); their expert ids), as
    `lax.top_k(softmax(logits), k)` gives them. `num_warps`: more warps shorten each of the k rounds' reductions.
    `num_tokens`: rows from here on are bucket padding, routed nowhere (expert -1)."""
    return _routing_call(logits, k, normalize, interpret, num_warps, num_tokens, False, weights_dtype)


@functools.partial(jax.jit, static_argnames=ROUTING_STATICS)
def top_k_routing_listed(logits: Float[Array, "tokens experts"], k: int, normalize: bool, interpret: bool = False,
                         num_warps: int = NUM_WARPS, num_tokens: Int[Array, ""] | None = None,
                         weights_dtype=jnp.float32,
                         ) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"], ChosenExperts]:
    """`top_k_routing` of a step of at most BLOCK_TOKENS tokens, with the distinct experts its routed tokens chose."""
    return _routing_call(logits, k, normalize, interpret, num_warps, num_tokens, True, weights_dtype)
