"""The combine back to token order: each token's k expert outputs added into one row, in either layout (Pallas,
Triton backend); optionally with the layer's residual add.

By token (`combine_pairs`) the down launch wrote the outputs in (token, choice) order; sorted (`combine_slots`) in
slots (`routing.expert_tiles`), found through each pair's slot. XLA fused the by-token sum with the residual add into
one kernel that took 7.7 µs a layer on an H100 for a 16-token step (512 KiB read; `scripts/probe_layer_loop_gpu.py
--part engine --engine-model qwen3-30b-a3b --hlo-dump`), and ran the sorted layout's as a gather of every (token,
choice) row: 24 µs a layer at 256 decode tokens on an H200. Here each program takes a column tile of 16 tokens: k
loads of `[16, block_n]` rows added in float32, left to right (as `routing.combine`, the XLA reference, adds them),
so a token's sum never depends on the step's other tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr
from jaxtyping import Array, Float, Int

BLOCK_TOKENS = 16
BLOCK_N = 64


def _combine_kernel(src_ref, choice_ref, *refs, k: int, by_token: bool, num_experts: int):
    """`choice_ref` `[tokens, k]`: by token, each choice's expert (row `t·k + c` of `src_ref` counts where the
    expert is in range); else each choice's row of `src_ref` (counts where in range). `refs`: (the residual, where
    the layer's residual add is fused here), the output."""
    residual_ref, out_ref = refs if len(refs) == 2 else (None, refs[0])
    tokens, n_dim = out_ref.shape
    src_rows = src_ref.shape[0]
    rows = pl.program_id(0) * BLOCK_TOKENS + jnp.arange(BLOCK_TOKENS, dtype=jnp.int32)
    cols = pl.program_id(1) * BLOCK_N + jnp.arange(BLOCK_N, dtype=jnp.int32)
    real, in_cols = rows < tokens, cols < n_dim
    safe_rows = jnp.minimum(rows, tokens - 1)
    total = None
    for c in range(k):  # left to right; a choice of another device's expert (or none) counts as zero
        choice = pltr.load(choice_ref.at[safe_rows, c])
        if by_token:
            kept, src = real & (choice >= 0) & (choice < num_experts), safe_rows * k + c
        else:
            kept, src = real & (choice >= 0) & (choice < src_rows), jnp.clip(choice, 0, src_rows - 1)
        part = pltr.load(src_ref.at[src[:, None], cols[None, :]], mask=kept[:, None] & in_cols[None, :],
                         other=0).astype(jnp.float32)
        total = part if total is None else total + part
    out = total.astype(out_ref.dtype)
    index, mask = out_ref.at[rows[:, None], cols[None, :]], real[:, None] & in_cols[None, :]
    if residual_ref is not None:  # the residual stream plus the rounded sum, rounded as the unfused add would be
        residual = pltr.load(residual_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0)
        out = (residual.astype(jnp.float32) + out.astype(jnp.float32)).astype(out_ref.dtype)
    pltr.store(index, out, mask=mask)


def _combine_call(src, choices, residual, *, by_token: bool, num_experts: int, interpret: bool):
    tokens, k = choices.shape
    d = src.shape[1]
    operands = (src, choices.astype(jnp.int32)) + (() if residual is None else (residual,))
    return pl.pallas_call(
        functools.partial(_combine_kernel, k=k, by_token=by_token, num_experts=num_experts),
        grid=(pl.cdiv(tokens, BLOCK_TOKENS), pl.cdiv(d, BLOCK_N)),
        in_specs=[pl.no_block_spec] * len(operands),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((tokens, d), src.dtype),
        compiler_params=pltr.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="moe_combine",
    )(*operands)


@functools.partial(jax.jit, static_argnames=("num_experts", "interpret"))
def combine_pairs(pair_out: Float[Array, "pairs d"], experts: Int[Array, "tokens k"], num_experts: int,
                  interpret: bool = False, residual: Float[Array, "tokens d"] | None = None,
                  ) -> Float[Array, "tokens d"]:
    """Each token's sum over its k rows of `pair_out` (row `t·k + c`: choice c of token t), in float32, left to
    right; the rows of a choice outside `[0, num_experts)` were never written and count as zero. `residual`: the
    layer's residual stream, added to the rounded sum here (one launch fewer a layer than XLA's add after it)."""
    return _combine_call(pair_out, experts, residual, by_token=True, num_experts=num_experts, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def combine_slots(slot_out: Float[Array, "slots d"], pair_slot: Int[Array, "tokens k"], interpret: bool = False,
                  residual: Float[Array, "tokens d"] | None = None) -> Float[Array, "tokens d"]:
    """The sorted layout's combine (`routing.expert_tiles`): each token's sum over its k slots' rows of `slot_out`,
    in float32, left to right, a slot past the end (a pair with none) counting as zero; `residual` as in
    `combine_pairs`. The same sums as `routing.combine`, which XLA ran as a gather of every (token, choice) row
    and its reduction: 24 us a layer at 256 decode tokens on an H200."""
    return _combine_call(slot_out, pair_slot, residual, by_token=False, num_experts=0, interpret=interpret)
