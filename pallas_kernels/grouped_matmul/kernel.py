"""Grouped (per-expert) matmuls for mixture-of-experts layers on NVIDIA GPUs (Pallas, Triton backend).

The rows come laid out by `routing.expert_tiles`: tile `t` of `block_rows` slots belongs to expert
`tile_expert[t]`, and slot `s` holds token `slot_token[s]` (-1: padding). Program `(t, j)` multiplies its tile's
rows by columns `j` of that one expert's weight, so a weight tile is read once per tile, tiles past `num_tiles`
return at once, and an expert nobody routed to is never read: at batch 1 only the k routed experts' bytes move.
Decode-sized steps skip that layout (`Layout` "by_token"): program `(e, j)` takes the step's tokens that chose
expert `e` and writes in (token, choice) order, summed by `combine.combine_pairs`.

The engine's tiles take a persistent grid instead (`TileConfig.workers_per_sm`): a few programs per SM loop over
the (row tile, column tile) pairs that have rows, since a grid with one program per possible tile is mostly programs
that find nothing (at one token, 8 of 128 experts' tiles have rows), and each of them holds its SM's pipelined
shared memory while it looks: 1.23-1.26× faster at 1 to 64 tokens on an H100, 1.13× at 4,096.

Two launches per MoE layer:
  * `expert_gate_up`: gathers its tokens' rows straight from the activations (no sorted copy of them), multiplies by
    the gate and the up weight in one pass over K (the row tile loaded once for both), and writes
    `act(gate) * up` for its slots;
  * `expert_down`: the slots' hidden rows times the down weight, scaled by each slot's routing weight.
The combine back to token order (a sum of k rows per token) is a third launch, `combine.combine_slots` (sorted) or
`combine.combine_pairs` (by token).

Weights may be stored in a narrower type than the activations (float8, int8) with a per-(expert, output column)
scale applied to the float32 accumulator, so quantized experts reuse the same kernels; `None` means unscaled. 4-bit
experts (AWQ, GPTQ, compressed-tensors W4A16) travel packed, `[experts, K / 8, N]` int32 words (input rows
8r … 8r + 7 of column c in word (r, c), row 8r + j at bits 4j), with a zero point and a scale per (expert, group of
input rows, column): each K step turns its words into the `[block_k, block_n]` tile `(q − z) · s` in registers
(`pallas_kernels/w4a16/nibbles.py`, no integer-to-float conversion) before the dot, so only 4 bits a weight move.
`precision` is `jnp.dot`'s: HIGHEST makes float32 products exact (IEEE) instead of TF32.

Triton rules (JAX-PALLAS.md §1.2): power-of-two tiles, ragged edges masked, block-table-style indices loaded in
the kernel, no scratch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr
from jaxtyping import Array, Float, Int

from pallas_kernels.addressing import next_pow2
from pallas_kernels.grouped_matmul.router import ChosenExperts
from pallas_kernels.grouped_matmul.routing import ExpertTiles
from pallas_kernels.w4a16.nibbles import PACK, affine, nibbles_as_float


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Static tile sizes of one launch; `block_rows` must match the routing's."""

    block_rows: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    # 0: one program per (row tile, column tile), tiles with no rows returning at once. n > 0: n programs per SM
    # loop over the step's tiles with rows only (`_for_each_tile`), so a decode step's grid is not mostly programs
    # that find no rows, each holding an SM's shared memory while it looks.
    workers_per_sm: int = 0


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How one launch's weights are stored and scaled (static). `none`: float weights. `column`: 8-bit, one scale per
    (expert, output column) `[experts, N]`, applied to the float32 accumulator. `block`: 8-bit, one scale per
    (expert, `rows` × `cols` block) `[experts, ceil(K / rows), ceil(N / cols)]` (DeepSeek / Qwen3-FP8's 128 × 128,
    or group-wise W8A16's `rows` × 1), applied to each K step's product (a step never straddles a block row).
    `int4`: 4-bit words with scales and zero points per (expert, group of `rows` input rows, column), dequantized
    in registers."""

    kind: Literal["none", "column", "block", "int4"] = "none"
    rows: int = 0
    cols: int = 1


def _arange(start, size: int):
    return start + jnp.arange(size, dtype=jnp.int32)


class Rows(NamedTuple):
    """What one program multiplies: its expert, the output rows its `block_rows` tile rows go to, their tokens
    (clamped to a real row) and which are real; `active` false: the program returns at once."""

    expert: Array
    out: Array
    token: Array
    real: Array
    active: Array


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a launch finds its rows (static). `sorted`: `routing.expert_tiles`' slots, program `t` of the row axis
    takes tile `t` (layout operands `slot_token`, `tile_expert`, `num_tiles`; down also `slot_weight`).
    `by_token`: no layout step at all: program `e` of the row axis is expert `e`, its rows are every token of the
    step (`tokens` ≤ `block_rows`) masked to those that chose `e`, and row `t`'s output is pair row `t·k + c` (`c`:
    the choice that named `e`) of a `[tokens · k, N]` output (operands `experts [tokens, k]`; down also the
    routing weights). A token's k choices must be distinct (as top-k's are). For decode-sized steps: it saves the
    layout's launches, and an expert nobody chose returns at once. `listed`: the distinct chosen experts come as
    operands (`router.ChosenExperts`) instead of each program finding them from every choice."""

    kind: Literal["sorted", "by_token"] = "sorted"
    tokens: int = 0
    k: int = 0
    experts: int = 0
    listed: bool = False


def _sorted_rows(refs, t, block_rows: int) -> Rows:
    slot_token_ref, tile_expert_ref, num_tiles_ref = refs
    slots = _arange(t * block_rows, block_rows)
    token = pltr.load(slot_token_ref.at[slots])
    return Rows(tile_expert_ref[t], slots, jnp.maximum(token, 0), token >= 0, t < num_tiles_ref[0])


def _token_choices(experts_ref, e, block_rows: int, layout: Layout):
    """(tokens, the choice of each that named expert `e` (0 where none), which chose it)."""
    tokens, choices = _arange(0, block_rows), _arange(0, next_pow2(layout.k))
    valid = (tokens[:, None] < layout.tokens) & (choices[None, :] < layout.k)
    ids = pltr.load(experts_ref.at[jnp.minimum(tokens, layout.tokens - 1)[:, None],
                                   jnp.minimum(choices, layout.k - 1)[None, :]], mask=valid, other=-1)
    match = ids == e
    choice = jnp.sum(jnp.where(match, choices[None, :], 0), axis=1)
    return tokens, choice, jnp.sum(match.astype(jnp.int32), axis=1) > 0


def _rows(layout: Layout, refs, t, block_rows: int) -> Rows:
    if layout.kind == "sorted":
        return _sorted_rows(refs, t, block_rows)
    tokens, choice, real = _token_choices(refs[0], t, block_rows, layout)
    return Rows(t, tokens * layout.k + choice, jnp.minimum(tokens, layout.tokens - 1), real,
                jnp.sum(real.astype(jnp.int32)) > 0)


def _chosen_experts(layout_refs, layout: Layout):
    """By token: (how many distinct experts the step chose, a function from `a` to the `a`-th of them in id
    order): as listed, or from one `[experts, pairs]` comparison of the step's choices in registers."""
    if layout.listed:
        ids_ref, count_ref = layout_refs[1:3]
        return count_ref[0], lambda a: ids_ref[a]
    experts_ref = layout_refs[1]
    pairs = layout.tokens * layout.k
    p = _arange(0, next_pow2(pairs))
    ids = pltr.load(experts_ref.at[jnp.minimum(p, pairs - 1)], mask=p < pairs, other=-1)
    e = _arange(0, next_pow2(layout.experts))
    hits = jnp.sum((ids[None, :] == e[:, None]).astype(jnp.int32), axis=1)
    chosen = ((hits > 0) & (e < layout.experts)).astype(jnp.int32)
    rank = jnp.cumsum(chosen, axis=0) - chosen
    return jnp.sum(chosen), lambda a: jnp.sum(jnp.where((chosen > 0) & (rank == a), e, 0))


def _for_each_tile(layout: Layout, layout_refs, cfg: TileConfig, workers: int, n_dim: int,
                   tile: Callable[[Rows, Array], None]) -> None:
    """Calls `tile(rows, j)` for this program's share of the step's (row tile, column tile) pairs. Without workers
    the grid is one program per pair and a row tile with no rows returns at once; with `workers` programs, program
    p takes the pairs p, p + workers, ... of the row tiles that have rows (sorted: the first `num_tiles`; by token:
    the chosen experts), so no program is launched to find nothing."""
    if not workers:
        t, j = pl.program_id(0), pl.program_id(1)  # read outside `when`: interpret mode has none inside a branch
        rows = _rows(layout, layout_refs, t, cfg.block_rows)
        pl.when(rows.active)(lambda: tile(rows, j))
        return
    n_cols = pl.cdiv(n_dim, cfg.block_n)
    if layout.kind == "sorted":
        count, row_of = layout_refs[2][0], lambda a: a
    else:
        count, row_of = _chosen_experts(layout_refs, layout)
    p = pl.program_id(0)

    def item(i, carry):
        w = p + i * workers
        tile(_rows(layout, layout_refs, row_of(w // n_cols), cfg.block_rows), w % n_cols)
        return carry

    lax.fori_loop(0, (count * n_cols - p + workers - 1) // workers, item, 0)


def _routing_weight(weight_ref, rows: Rows):
    """Each row's routing weight (float32; 0 for padding), stored at its output row in either layout."""
    return pltr.load(weight_ref.at[rows.out], mask=rows.real, other=0).astype(jnp.float32)


def _weight_tile(w_ref, e, ks, cols, k_dim: int, n_dim: int, dtype, cfg: TileConfig):
    """One expert's `[block_k, block_n]` weight tile in the compute dtype. Edges are masked only where the shape
    has them (static), and masked lanes zeroed after the cast: Triton cannot splat a fill value into float8."""
    index = w_ref.at[e, ks[:, None], cols[None, :]]
    if k_dim % cfg.block_k == 0 and n_dim % cfg.block_n == 0:
        return pltr.load(index).astype(dtype)
    mask = (ks[:, None] < k_dim) & (cols[None, :] < n_dim)
    return jnp.where(mask, pltr.load(index, mask=mask).astype(dtype), 0)


def _int4_tile(w_ref, z_ref, s_ref, e, k0, cols, n_dim: int, dtype, block_k: int, group: int):
    """One expert's `[block_k, block_n]` 4-bit weight tile, dequantized: `(1 + q/16) · 16s − s(16 + z) =
    (q − z) · s` per (row, column), the zero point and scale of each row's group (one group per step when
    `block_k ≤ group`). K needs no mask (`block_k` divides it); a ragged N edge is masked where the shape has one
    (static)."""
    word_rows = _arange(k0 // PACK, block_k // PACK)
    ragged = n_dim % cols.shape[0] != 0

    def load(ref, index, shape):
        if not ragged:
            return pltr.load(ref.at[index])
        return pltr.load(ref.at[index], mask=jnp.broadcast_to(cols < n_dim, shape), other=0)

    block_n = cols.shape[0]
    words = load(w_ref, (e, word_rows[:, None], cols[None, :]), (block_k // PACK, block_n))
    if block_k <= group:
        index, shape = (e, k0 // group, cols), (block_n,)
    else:
        index, shape = (e, (word_rows // (group // PACK))[:, None], cols[None, :]), (block_k // PACK, block_n)
    zero = load(z_ref, index, shape).astype(jnp.float32)
    scale = load(s_ref, index, shape).astype(jnp.float32)
    if block_k <= group:
        zero, scale = zero[None, :], scale[None, :]
    a, b = affine(zero, scale)
    return (nibbles_as_float(words) * a + b).reshape(block_k, block_n).astype(dtype)


def _expert_tile(w_ref, s_ref, z_ref, e, k0, cols, k_dim: int, n_dim: int, dtype, cfg: TileConfig,
                 scaling: Scaling):
    """The step's weight tile in the compute dtype: 4-bit words dequantized in registers, float and 8-bit weights
    cast (their scales apply to the products: `_scaled_step`, `_column_scale`)."""
    if scaling.kind == "int4":
        return _int4_tile(w_ref, z_ref, s_ref, e, k0, cols, n_dim, dtype, cfg.block_k, scaling.rows)
    return _weight_tile(w_ref, e, _arange(k0, cfg.block_k), cols, k_dim, n_dim, dtype, cfg)


def _scaled_step(part, s_ref, e, k0, cols, n_dim: int, scaling: Scaling):
    """One K step's float32 product with its block scales (`block`: the step lies in one block row), else as is."""
    if scaling.kind != "block":
        return part
    index = s_ref.at[e, k0 // scaling.rows, cols // scaling.cols]
    scale = pltr.load(index) if n_dim % cols.shape[0] == 0 else pltr.load(index, mask=cols < n_dim, other=0.0)
    return part * scale[None, :]


def _column_scale(scale_ref, e, cols, n_dim: int):
    return pltr.load(scale_ref.at[e, cols], mask=cols < n_dim, other=0.0)[None, :]


def _gate_up_kernel(x_ref, wg_ref, wu_ref, sg_ref, su_ref, zg_ref, zu_ref, perm_ref, *refs, cfg: TileConfig,
                    act: Callable, precision, scaling: Scaling, layout: Layout, workers: int):
    *layout_refs, h_ref = refs
    k_dim, n_dim = x_ref.shape[1], wg_ref.shape[2]

    def tile(rows: Rows, j):
        e, token, real = rows.expert, rows.token, rows.real
        cols = _arange(j * cfg.block_n, cfg.block_n)

        def step(i, acc):
            k0 = i * cfg.block_k
            ks = _arange(k0, cfg.block_k)
            if perm_ref is not None:  # the weight's rows are the features perm[e, k] (block_k divides K: no edge)
                features = pltr.load(perm_ref.at[e, ks])
                x = pltr.load(x_ref.at[token[:, None], features[None, :]], mask=real[:, None], other=0)
            else:
                x = pltr.load(x_ref.at[token[:, None], ks[None, :]], mask=real[:, None] & (ks[None, :] < k_dim),
                              other=0)

            def product(w_ref, s_ref, z_ref):
                w = _expert_tile(w_ref, s_ref, z_ref, e, k0, cols, k_dim, n_dim, x.dtype, cfg, scaling)
                part = jnp.dot(x, w, preferred_element_type=jnp.float32, precision=precision)
                return _scaled_step(part, s_ref, e, k0, cols, n_dim, scaling)

            return acc[0] + product(wg_ref, sg_ref, zg_ref), acc[1] + product(wu_ref, su_ref, zu_ref)

        zeros = jnp.zeros((cfg.block_rows, cfg.block_n), jnp.float32)
        gate, up = lax.fori_loop(0, pl.cdiv(k_dim, cfg.block_k), step, (zeros, zeros))
        if scaling.kind == "column":
            gate, up = gate * _column_scale(sg_ref, e, cols, n_dim), up * _column_scale(su_ref, e, cols, n_dim)
        h = act(gate) * up
        pltr.store(h_ref.at[rows.out[:, None], cols[None, :]], h.astype(h_ref.dtype), mask=_store_mask(rows, cols,
                                                                                                     n_dim))

    _for_each_tile(layout, layout_refs, cfg, workers, n_dim, tile)


def _store_mask(rows: Rows, cols, n_dim: int):
    """Real rows only: by token, a row that did not choose the expert is another program's pair row; sorted padding
    slots are never read (down masks them, the combine never gathers them)."""
    return (cols[None, :] < n_dim) & rows.real[:, None]


def _down_kernel(h_ref, wd_ref, sd_ref, zd_ref, *refs, cfg: TileConfig, precision, scaling: Scaling, layout: Layout,
                 workers: int):
    *layout_refs, weight_ref, y_ref = refs
    k_dim, n_dim = h_ref.shape[1], wd_ref.shape[2]

    def tile(rows: Rows, j):
        e = rows.expert
        cols = _arange(j * cfg.block_n, cfg.block_n)

        def step(i, acc):
            k0 = i * cfg.block_k
            ks = _arange(k0, cfg.block_k)
            h = pltr.load(h_ref.at[rows.out[:, None], ks[None, :]], mask=rows.real[:, None] & (ks[None, :] < k_dim),
                          other=0)
            w = _expert_tile(wd_ref, sd_ref, zd_ref, e, k0, cols, k_dim, n_dim, h.dtype, cfg, scaling)
            part = jnp.dot(h, w, preferred_element_type=jnp.float32, precision=precision)
            return acc + _scaled_step(part, sd_ref, e, k0, cols, n_dim, scaling)

        acc = lax.fori_loop(0, pl.cdiv(k_dim, cfg.block_k), step,
                            jnp.zeros((cfg.block_rows, cfg.block_n), jnp.float32))
        if scaling.kind == "column":
            acc = acc * _column_scale(sd_ref, e, cols, n_dim)
        weight = _routing_weight(weight_ref, rows)
        pltr.store(y_ref.at[rows.out[:, None], cols[None, :]], (acc * weight[:, None]).astype(y_ref.dtype),
                   mask=_store_mask(rows, cols, n_dim))

    _for_each_tile(layout, layout_refs, cfg, workers, n_dim, tile)


class TokenChoices(NamedTuple):
    """The `by_token` layout's operands: each token's k expert ids (outside `[0, experts)`: none) and their routing
    weights (any float type, widened to float32 where loaded), flat in pair order (`t·k + c`); optionally the
    distinct experts chosen, as the router lists them."""

    experts: Int[Array, "tokens k"]
    weights: Float[Array, " pairs"]
    chosen: ChosenExperts | None = None


def _layout_of(rows_of: ExpertTiles | TokenChoices, num_experts: int, block_rows: int):
    """(Layout, its operands for gate/up, the routing weights down adds, output rows, row tiles that can have
    rows)."""
    if isinstance(rows_of, ExpertTiles):
        slots = rows_of.slot_token.shape[0]
        return (Layout(), (rows_of.slot_token, rows_of.tile_expert, rows_of.num_tiles), rows_of.slot_weight, slots,
                slots // block_rows)
    tokens, k = rows_of.experts.shape
    if tokens > block_rows:
        raise ValueError(f"the by-token layout takes at most block_rows ({block_rows}) tokens, got {tokens}")
    experts = rows_of.experts.astype(jnp.int32)
    chosen = rows_of.chosen
    if chosen is None:
        operands = (experts, experts.reshape(-1))
    else:
        operands = (experts, chosen.ids.astype(jnp.int32), chosen.count.astype(jnp.int32))
    return (Layout("by_token", tokens, k, num_experts, chosen is not None), operands, rows_of.weights, tokens * k,
            num_experts)


def multiprocessors() -> int:
    """Streaming multiprocessors of the default device (its `core_count`); 8 where it has none (the CPU, whose
    interpret mode runs the same loop)."""
    return getattr(jax.devices()[0], "core_count", None) or 8


def _workers(cfg: TileConfig, layout: Layout, row_tiles: int, n_dim: int) -> int:
    """Programs of a `workers_per_sm` launch (0: one per tile): never more than the step can have tiles."""
    if not cfg.workers_per_sm:
        return 0
    if layout.kind == "by_token":
        row_tiles = min(row_tiles, layout.tokens * layout.k)
    return min(row_tiles * pl.cdiv(n_dim, cfg.block_n), multiprocessors() * cfg.workers_per_sm)


def _launch(kernel, operands, out_shape, row_tiles: int, n_dim: int, cfg: TileConfig, workers: int,
            interpret: bool, name: str):
    return pl.pallas_call(
        kernel,
        grid=(workers,) if workers else (row_tiles, pl.cdiv(n_dim, cfg.block_n)),
        in_specs=[pl.no_block_spec] * len(operands),
        out_specs=pl.no_block_spec,
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=name,
    )(*operands)


def _optional(kernel, present: tuple[bool, ...]):
    """Binds the kernel's optional scale refs to None where absent (pallas_call takes arrays only)."""
    def bound(*refs):
        refs = list(refs)
        full = [refs.pop(0) if here else None for here in present] + refs
        return kernel(*full)
    return bound


def int4_group(k_dim: int, zeros: Array | None) -> int:
    """Input rows per group of a 4-bit stack whose zero points are `[experts, groups, N]` (0 when not 4-bit)."""
    if zeros is None:
        return 0
    groups = zeros.shape[1]
    if k_dim % groups or (k_dim // groups) % 16:
        raise ValueError(f"4-bit experts need whole groups of a multiple of 16 input rows ({k_dim} rows in {groups} "
                         "groups)")
    return k_dim // groups


def scaling_of(w: Array, k_dim: int, scale: Array | None, zero: Array | None,
               scale_block: tuple[int, int] | None) -> Scaling:
    """The launch's `Scaling` from its operands: zero points mean 4-bit words, `[experts, N]` scales one per column,
    `[experts, K blocks, N blocks]` ones blocks of `scale_block`; checked against the weight's shape."""
    if zero is not None:
        group = int4_group(k_dim, zero)
        if scale is None or w.dtype != jnp.int32 or w.shape[1] * PACK != k_dim:
            raise ValueError(f"4-bit experts are int32 words [experts, K / 8, N] with group scales: got {w.dtype} "
                             f"{w.shape} for K={k_dim}")
        return Scaling("int4", group)
    if scale is None:
        return Scaling()
    if scale.ndim == 2:
        return Scaling("column")
    if scale_block is None:
        raise ValueError("block scales [experts, K blocks, N blocks] need their scale_block (rows, columns)")
    rows, cols = scale_block
    expected = (w.shape[0], -(-k_dim // rows), -(-w.shape[2] // cols))
    if scale.shape != expected:
        raise ValueError(f"block scales of {rows} x {cols} on a {w.shape} weight are {expected}, not {scale.shape}")
    return Scaling("block", rows, cols)


def _check_steps(scaling: Scaling, k_dim: int, cfg: TileConfig) -> None:
    """A K step must lie in one block row (block scales), or divide K and align with the groups (4-bit)."""
    if scaling.kind == "block" and scaling.rows % cfg.block_k:
        raise ValueError(f"block_k {cfg.block_k} must divide the scale blocks' {scaling.rows} rows")
    if scaling.kind == "int4" and (k_dim % cfg.block_k or (scaling.rows % cfg.block_k and
                                                           cfg.block_k % scaling.rows)):
        raise ValueError(f"block_k {cfg.block_k} must divide K ({k_dim}) and divide or be a multiple of the group "
                         f"({scaling.rows}) for 4-bit experts (moe.fit_steps picks one)")


@functools.partial(jax.jit, static_argnames=("act", "cfg", "interpret", "precision", "scale_block"))
def expert_gate_up(
    x: Float[Array, "tokens d"], w_gate: Float[Array, "experts d inter"], w_up: Float[Array, "experts d inter"],
    tiles: ExpertTiles | TokenChoices, *, act: Callable, cfg: TileConfig, interpret: bool = False, precision=None,
    gate_scale: Float[Array, "experts ..."] | None = None, up_scale: Float[Array, "experts ..."] | None = None,
    gate_zero: Float[Array, "experts groups inter"] | None = None,
    up_zero: Float[Array, "experts groups inter"] | None = None, scale_block: tuple[int, int] | None = None,
    input_perm: Int[Array, "experts d"] | None = None,
) -> Float[Array, "slots inter"]:
    """`act(x·W_gate[e]) * (x·W_up[e])` for every slot's token and expert (padding slots: not written, never
    read). The weights' storage and scales as `scaling_of` reads them (gate and up alike). `input_perm` (4-bit
    only): expert e's stored weight row k multiplies feature `input_perm[e, k]` of x (GPTQ's activation order, rows
    sorted by group). `tiles`: the rows as `routing.expert_tiles` lays them out, or as each token chose (`Layout`)."""
    inter = w_gate.shape[2]
    layout, layout_ops, _, out_rows, row_tiles = _layout_of(tiles, w_gate.shape[0], cfg.block_rows)
    if (gate_scale is None) != (up_scale is None) or (gate_zero is None) != (up_zero is None):
        raise ValueError("gate and up weights are scaled (and 4-bit) both or neither")
    scaling = scaling_of(w_gate, x.shape[1], gate_scale, gate_zero, scale_block)
    if scaling_of(w_up, x.shape[1], up_scale, up_zero, scale_block) != scaling:
        raise ValueError("gate and up weights must be stored and scaled alike")
    _check_steps(scaling, x.shape[1], cfg)
    if input_perm is not None and (scaling.kind != "int4" or input_perm.shape != (w_gate.shape[0], x.shape[1])):
        raise ValueError("input_perm [experts, d] goes with 4-bit experts")
    scales = () if gate_scale is None else (gate_scale, up_scale)
    zeros = () if gate_zero is None else (gate_zero, up_zero)
    perm = () if input_perm is None else (input_perm.astype(jnp.int32),)
    workers = _workers(cfg, layout, row_tiles, inter)
    kernel = functools.partial(_gate_up_kernel, cfg=cfg, act=act, precision=precision, scaling=scaling,
                               layout=layout, workers=workers)
    kernel = _optional(kernel, (True,) * 3 + (bool(scales),) * 2 + (bool(zeros),) * 2 + (bool(perm),))
    operands = (x, w_gate, w_up, *scales, *zeros, *perm, *layout_ops)
    return _launch(kernel, operands, jax.ShapeDtypeStruct((out_rows, inter), x.dtype), row_tiles, inter, cfg, workers,
                   interpret, "expert_gate_up")


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "precision", "scale_block"))
def expert_down(
    h: Float[Array, "rows inter"], w_down: Float[Array, "experts inter d"], tiles: ExpertTiles | TokenChoices, *,
    cfg: TileConfig, interpret: bool = False, precision=None, down_scale: Float[Array, "experts ..."] | None = None,
    down_zero: Float[Array, "experts groups d"] | None = None, scale_block: tuple[int, int] | None = None,
) -> Float[Array, "rows d"]:
    """Each row's hidden features times its expert's down weight, times its routing weight (storage as gate/up's;
    rows laid out as `expert_gate_up`'s)."""
    d = w_down.shape[2]
    layout, layout_ops, routing_weights, out_rows, row_tiles = _layout_of(tiles, w_down.shape[0], cfg.block_rows)
    scaling = scaling_of(w_down, h.shape[1], down_scale, down_zero, scale_block)
    _check_steps(scaling, h.shape[1], cfg)
    workers = _workers(cfg, layout, row_tiles, d)
    kernel = functools.partial(_down_kernel, cfg=cfg, precision=precision, scaling=scaling, layout=layout,
                               workers=workers)
    kernel = _optional(kernel, (True, True, down_scale is not None, down_zero is not None))
    operands = (h, w_down, *(() if down_scale is None else (down_scale,)),
                *(() if down_zero is None else (down_zero,)), *layout_ops, routing_weights)
    return _launch(kernel, operands, jax.ShapeDtypeStruct((out_rows, d), h.dtype), row_tiles, d, cfg, workers,
                   interpret, "expert_down")
