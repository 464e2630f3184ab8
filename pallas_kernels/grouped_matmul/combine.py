"""The by-token layout's combine: each token's k expert outputs, written in (token, choice) order by the down launch,
added into one row (Pallas, Triton backend).

XLA fused this sum with the residual add into one kernel that took 7.7 µs a layer on an H100 for a 16-token step
(512 KiB read; `scripts/probe_layer_loop_gpu.py --part engine --engine-model qwen3-30b-a3b --hlo-dump`). Here each
program takes a column tile of every token: k loads of `[16, block_n]` rows added in float32, left to right (as
`routing.combine` adds the sorted layout's), so a token's sum never depends on the step's other tokens.
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


def _combine_kernel(pair_ref, experts_ref, *refs, k: int, num_experts: int):
    """`refs`: (the residual, where the layer's residual add is fused here), the output."""
    residual_ref, out_ref = refs if len(refs) == 2 else (None, refs[0])
    tokens, n_dim = out_ref.shape
    rows = pl.program_id(0) * BLOCK_TOKENS + jnp.arange(BLOCK_TOKENS, dtype=jnp.int32)
    cols = pl.program_id(1) * BLOCK_N + jnp.arange(BLOCK_N, dtype=jnp.int32)
    real, in_cols = rows < tokens, cols < n_dim
    safe_rows = jnp.minimum(rows, tokens - 1)
    total = None
    for c in range(k):  # left to right; a choice of another device's expert (or none) counts as zero
        expert = pltr.load(experts_ref.at[safe_rows, c])
        kept = real & (expert >= 0) & (expert < num_experts)
        part = pltr.load(pair_ref.at[(safe_rows * k + c)[:, None], cols[None, :]],
                         mask=kept[:, None] & in_cols[None, :], other=0).astype(jnp.float32)
        total = part if total is None else total + part
    out = total.astype(out_ref.dtype)
    index, mask = out_ref.at[rows[:, None], cols[None, :]], real[:, None] & in_cols[None, :]
    if residual_ref is not None:  # the residual stream plus the rounded sum, rounded as the unfused add would be
        residual = pltr.load(residual_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0)
        out = (residual.astype(jnp.float32) + out.astype(jnp.float32)).astype(out_ref.dtype)
    pltr.store(index, out, mask=mask)


@functools.partial(jax.jit, static_argnames=("num_experts", "interpret"))
def combine_pairs(pair_out: Float[Array, "pairs d"], experts: Int[Array, "tokens k"], num_experts: int,
                  interpret: bool = False, residual: Float[Array, "tokens d"] | None = None,
                  ) -> Float[Array, "tokens d"]:
    """Each token's sum over its k rows of `pair_out` (row `t·k + c`: choice c of token t), in float32, left to
    right; the rows of a choice outside `[0, num_experts)` were never written and count as zero. `residual`: the
    layer's residual stream, added to the rounded sum here (one launch fewer a layer than XLA's add after it)."""
    tokens, k = experts.shape
    d = pair_out.shape[1]
    operands = (pair_out, experts.astype(jnp.int32)) + (() if residual is None else (residual,))
    return pl.pallas_call(
        functools.partial(_combine_kernel, k=k, num_experts=num_experts),
        grid=(pl.cdiv(tokens, BLOCK_TOKENS), pl.cdiv(d, BLOCK_N)),
        in_specs=[pl.no_block_spec] * len(operands),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((tokens, d), pair_out.dtype),
        compiler_params=pltr.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="moe_combine",
    )(*operands)
