"""Ragged paged attention for NVIDIA GPUs (Pallas, Triton backend), reading K/V pages straight from the cache.

Semantics are those of `reference.ragged_paged_attention` (and of jengine's pure-jnp oracle): the batch is flattened,
request `b` owns tokens `query_start_loc[b]:query_start_loc[b + 1]`, which are the *last* `q_len` of its `seq_lens[b]`
cached positions; each new token attends causally over its own request's positions (optionally only the last
`sliding_window` of them, optionally with a logit soft cap). The KV cache is one array
`[layers, blocks, block_size, 2, kv_heads, head_dim]` (K at 0 / V at 1 of axis 3) and `layer` is a traced scalar, so
the kernel takes the whole cache and computes page addresses itself (64-bit offsets past 4 GiB, done by the lowering).

Why two launches. A decode has one query row per query head; a prefill chunk has thousands. One program shape cannot
serve both: a 128-row query tile wastes 97 % of its tensor-core work on a decode, and a decode program that walks a
32k context alone leaves the GPU idle when the batch is small. So one step runs
  * the *decode* kernel, grid `(seqs, kv_heads, max_splits)`, for requests with at most `block_m // group_pad` new
    tokens: all query heads of one KV head in one 16-row tile, the context split into chunks whose count depends only
    on the request's own length (flash decoding); a small merge kernel combines the splits in a fixed order (the same
    numbers alone or in any batch) and writes the rows into the output in place;
  * the *prefill* kernel, grid `(query_tiles, kv_heads)`, for the other requests: a tile of `block_m` rows = tokens ×
    query heads of one KV head, the loop over its visible KV split into masked edges and an unmasked middle.
The prefill launch is skipped when `max_query_len` (static) shows that every request fits the decode kernel, and
the merge when the block table's width (static) shows that every context fits one split: the decode kernel then
writes its rows into the output itself, the bits the merge of one split would write. In the batch-invariant mode's
long-context segments a short step's prefill may also split (`Tuning.segments_apart`): grid
`(query_tiles, kv_heads, segments)`, then a merge launch that folds each tile's segments in order.

float8 cache (`kv_scales` given, see `pallas_kernels.kv_quant`): the cache is read through its uint16 byte-pair view
(`addressing.as_byte_pairs`: addressable at any size, where single bytes overflow the lowering's 32-bit offsets in
(2, 4] GiB), half the bytes of bf16, and each pair is unpacked in registers into the even and odd columns
(`unpack_fp8_pairs`), so every tile is split into two column parts and each dot product into two. The per-(layer,
KV head) scales are scalars for a whole program, so they are applied where they cost nothing: K's scale joins the
softmax scale that multiplies the scores, V's scale multiplies the finished output rows. The unpacked halves are
bfloat16 operands by default; `Tuning.fp8_operands="float16"` makes them float16 (e4m3 → float16 is one conversion
a pair on Hopper), with the query scaled by 2^-4 into float16's range (`tiles.Scores`); float32 queries keep float32.

Backend: `pl.pallas_call` lowers through Triton on GPU, which jax 0.11.2 marks deprecated (a warning at lowering)
but runs correctly on the H200; a Mosaic GPU (`plgpu.kernel`) port is the way to more prefill throughput.
Triton rules obeyed here (JAX-PALLAS.md §1.2): every loaded or computed block has a power-of-two element count
(ragged edges are masked), no scalar prefetch (block-table entries and lengths are loaded inside the kernel), no
scratch. Rows of padding tokens come back as zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltr
from jaxtyping import Array, Float, Int

from pallas_kernels.addressing import UnsupportedShapeError, as_byte_pairs
from pallas_kernels.kv_quant import KVScales, check_kv_scales
from pallas_kernels.ragged_paged_attention import mosaic_decode, mosaic_prefill
from pallas_kernels.ragged_paged_attention.tiles import (
    Geometry,
    KVSource,
    Scores,
    attend,
    attend_in_segments,
    cdiv,
    column_index,
    empty_state,
    finish,
    head_scales,
    latest_first,
    load_q,
    merge_partial,
    merged_rows,
    num_partials,
    num_segments,
    num_splits,
    query_rows,
    segment_rows,
    split_range,
    store_rows,
    tokens_per_tile,
    visible_range,
    zero_padding_rows,
)
from pallas_kernels.ragged_paged_attention.tuning import KernelConfig, SplitConfig, Tuning, default_tuning

SUPPORTED_HEAD_DIMS = (64, 128)
# The segment-parallel prefill's partial rows at most (`Tuning.segments_apart`): a short step of many requests over a
# wide table keeps the one-program walk, whose programs are then many already, rather than this much scratch
MAX_SEGMENT_PARTIAL_BYTES = 128 << 20
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)

KVCache = Float[Array, "layers blocks block_size 2 kv_heads head_dim"]


def check_supported(*, head_dim: int, block_size: int, num_q_heads: int, num_kv_heads: int) -> None:
    """Raises `UnsupportedShapeError` naming the first unsupported dimension (backends use it to fall back)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise UnsupportedShapeError(f"head_dim={head_dim} is not supported (supported: {SUPPORTED_HEAD_DIMS})")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise UnsupportedShapeError(f"block_size={block_size} is not supported (supported: {SUPPORTED_BLOCK_SIZES})")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise UnsupportedShapeError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if num_q_heads // num_kv_heads > 64:
        raise UnsupportedShapeError(f"{num_q_heads // num_kv_heads} query heads per KV head (at most 64)")


# ---------------------------------------------------------------------------------------------------------------
# The two kernels.


def _decode_kernel(layer_ref, window_ref, qsl_ref, lens_ref, bt_ref, q_ref, kv_ref, scales_ref, *out_refs,
                   geo: Geometry, cfg: KernelConfig, split: SplitConfig, scores: Scores, direct: bool, fresh: bool):
    """Program (request b, KV head h, split s): chunk s of b's visible context for all of b's query rows. Only the
    rows of real (token, head) pairs are stored, so the partial buffers cost traffic for real rows alone.
    `out_refs`: the split's partial output and LSE; or, `direct` (every request's context is one split), the step's
    output, which gets the rows as the merge would have written them: aliased in and out (beside a prefill's
    rows), or `fresh` (a decode-only step), when the programs also write the padding tokens' zeros."""
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if fresh:
        zero_padding_rows(out_refs[-1], qsl_ref, b, h, geo, tokens_per_tile(geo, cfg))
    q_start = qsl_ref[b]
    q_len = qsl_ref[b + 1] - q_start
    seq_len = lens_ref[b]
    window = window_ref[0]
    first_pos, last_pos = seq_len - q_len, seq_len - 1
    lo, hi = visible_range(first_pos, last_pos, window, cfg.block_n)
    my_lo, my_hi = split_range(lo, hi, s, split, cfg.block_n)
    active = (q_len >= 1) & (q_len <= tokens_per_tile(geo, cfg)) & (s < num_splits(lo, hi, split))

    @pl.when(active)
    def _():
        t, g = query_rows(cfg.block_m, geo.group, geo.group_pad)
        valid = (t < q_len) & (g < geo.group)
        tok = jnp.where(valid, q_start + t, 0)
        head = jnp.where(valid, h * geo.group + g, 0)
        q = scores.operands(load_q(q_ref, tok, head, valid, geo.parts))
        src = KVSource(kv_ref, bt_ref, b, layer_ref[0], h, hi, geo.block_size, cfg.prefetch_pages)
        k_scale, v_scale = head_scales(scales_ref, layer_ref[0], h, geo)
        if split.absolute and split.fold < split.split_tokens:  # several segments a chunk: each its own partial
            if direct:  # the one chunk's segments folded here, as the merge and the prefill kernel fold them
                out = attend_in_segments(q, first_pos + t, src, lo, hi, first_pos, last_pos, window,
                                         block_n=cfg.block_n, scores=scores, segment=split.fold, k_scale=k_scale,
                                         v_scale=v_scale)
                store_rows(out_refs[-1], tok, head, valid, tuple(0.0 + part for part in out))
                return
            segment_of = functools.partial(segment_rows, q, first_pos + t, src, lo, hi, first_pos=first_pos,
                                           last_pos=last_pos, window=window, block_n=cfg.block_n, scores=scores,
                                           segment=split.fold, k_scale=k_scale, v_scale=v_scale)
            first = my_lo // split.fold - lo // split.fold  # the chunk's first segment, counted from lo's

            def one_segment(j, _):
                _store_partial(out_refs, (b, h, first + j), valid, *segment_of(first + j), geo, cfg)

            lax.fori_loop(0, num_segments(my_lo, my_hi, split.fold), one_segment, None)
            return
        acc, m, l = attend(q, first_pos + t, src, my_lo, my_hi, first_pos, last_pos, window,
                            block_n=cfg.block_n, scores=scores, k_scale=k_scale)
        out, lse = finish(acc, m, l, v_scale)
        if direct:
            # The merge of one split sums it onto zeros (turning a -0.0 into +0.0): 0.0 + x gives its bits exactly,
            # so a request's rows do not depend on whether its step's block table was narrow enough for this path.
            store_rows(out_refs[-1], tok, head, valid, tuple(0.0 + part for part in out))
            return
        _store_partial(out_refs, (b, h, s), valid, out, lse, geo, cfg)


def _store_partial(out_refs, at: tuple, valid, out, lse, geo: Geometry, cfg: KernelConfig):
    """One partial result's real rows (column parts) and LSEs into the partial buffers at `[*at]`."""
    o_ref, lse_ref = out_refs
    rows = jnp.where(valid, jnp.arange(cfg.block_m, dtype=jnp.int32), cfg.block_m)[:, None]
    for i, part in enumerate(out):
        cols = column_index(geo.head_dim, geo.parts, i)
        pltr.store(o_ref.at[(*at, rows, cols)], part, mask=jnp.broadcast_to(valid[:, None], part.shape))
    pltr.store(lse_ref.at[(*at, rows[:, 0])], lse, mask=valid)


def _fold_splits(o_part_ref, lse_part_ref, lead: tuple, valid, count, geo: Geometry, cfg: KernelConfig):
    """The first `count` splits' normalised rows at `[*lead, split]` of the partial buffers, folded in split order
    by their base-2 LSE (`merge_partial`; fixed, so the numbers do not depend on the batch): the merged rows."""
    rows = jnp.where(valid, jnp.arange(cfg.block_m, dtype=jnp.int32), 0)
    cols = column_index(geo.head_dim)
    mask2 = jnp.broadcast_to(valid[:, None], (cfg.block_m, geo.head_dim))

    def body(s, carry):
        lse = pltr.load(lse_part_ref.at[(*lead, s, rows)], mask=valid, other=-jnp.inf)
        o = pltr.load(o_part_ref.at[(*lead, s, rows[:, None], cols)], mask=mask2, other=0.0)
        return merge_partial(carry, (o,), lse)

    acc, _, den = lax.fori_loop(0, count, body, empty_state(((cfg.block_m, geo.head_dim),)))
    (out,) = merged_rows(acc, den)
    return out


def _merge_kernel(window_ref, qsl_ref, lens_ref, o_part_ref, lse_part_ref, *out_refs,
                  geo: Geometry, cfg: KernelConfig, split: SplitConfig, fresh: bool):
    """Program (request b, KV head h): combines b's used splits by their base-2 LSE, in split order (fixed, so the
    numbers do not depend on the batch), and writes the rows into the output: in place (`out_refs` the aliased
    input and the output, beside a prefill's rows), or `fresh` (a decode-only step) with the padding tokens'
    zeros."""
    out_ref = out_refs[-1]
    b, h = pl.program_id(0), pl.program_id(1)
    if fresh:
        zero_padding_rows(out_ref, qsl_ref, b, h, geo, tokens_per_tile(geo, cfg))
    q_start = qsl_ref[b]
    q_len = qsl_ref[b + 1] - q_start
    seq_len = lens_ref[b]
    lo, hi = visible_range(seq_len - q_len, seq_len - 1, window_ref[0], cfg.block_n)

    @pl.when((q_len >= 1) & (q_len <= tokens_per_tile(geo, cfg)))
    def _():
        t, g = query_rows(cfg.block_m, geo.group, geo.group_pad)
        valid = (t < q_len) & (g < geo.group)
        out = _fold_splits(o_part_ref, lse_part_ref, (b, h), valid, num_partials(lo, hi, split), geo, cfg)
        tok = q_start + t
        head = jnp.where(valid, h * geo.group + g, 0)
        store_rows(out_ref, tok, head, valid, (out,))


def _tile_rows(qsl_ref, lens_ref, window_ref, b, q0, geo: Geometry, cfg: KernelConfig):
    """A real prefill tile (request b, from its new token q0): its first and last positions, which of its rows are
    real, their tokens in the flat batch, and the KV range `[lo, hi)` its rows can see."""
    t, g = query_rows(cfg.block_m, geo.group, geo.group_pad)
    q_start = qsl_ref[b]
    q_len = qsl_ref[b + 1] - q_start
    n_tok = jnp.minimum(tokens_per_tile(geo, cfg), q_len - q0)
    first_pos = lens_ref[b] - q_len + q0
    last_pos = first_pos + n_tok - 1
    valid = (t < n_tok) & (g < geo.group)
    tok = jnp.where(valid, q_start + q0 + t, 0)
    lo, hi = visible_range(first_pos, last_pos, window_ref[0], cfg.block_n)
    return first_pos, last_pos, valid, tok, lo, hi


def _zero_spare_tile(o_ref, q0, h, geo: Geometry, cfg: KernelConfig):
    """A spare tile (past the last request's) writes zeros into the padding tokens' rows from token q0."""
    t, g = query_rows(cfg.block_m, geo.group, geo.group_pad)
    tok = q0 + t
    valid = (tok < geo.num_tokens) & (g < geo.group)
    store_rows(o_ref, tok, jnp.where(g < geo.group, h * geo.group + g, 0), valid,
               (jnp.zeros((cfg.block_m, geo.head_dim), o_ref.dtype),))


def _prefill_kernel(layer_ref, window_ref, qsl_ref, lens_ref, bt_ref, tile_seq_ref, tile_q0_ref, q_ref, kv_ref,
                    scales_ref, *out_refs, geo: Geometry, cfg: KernelConfig, scores: Scores, segment: int | None):
    """Program (query tile i, KV head h). Real tiles attend (`segment`: in the batch-invariant mode's absolute
    segments, folded as a decode's splits are merged); spare tiles (tile_seq == num_seqs) zero the rows of padding
    tokens, so the output holds no uninitialised memory. `out_refs`: the output (after the aliased input it
    updates in place, if any)."""
    o_ref = out_refs[-1]
    i, h = pl.program_id(0), pl.program_id(1)
    b, q0 = tile_seq_ref[i], tile_q0_ref[i]
    t, g = query_rows(cfg.block_m, geo.group, geo.group_pad)
    head = jnp.where(g < geo.group, h * geo.group + g, 0)

    @pl.when(b < geo.num_seqs)
    def _():
        window = window_ref[0]
        first_pos, last_pos, valid, tok, lo, hi = _tile_rows(qsl_ref, lens_ref, window_ref, b, q0, geo, cfg)
        q = scores.operands(load_q(q_ref, tok, head, valid, geo.parts))
        src = KVSource(kv_ref, bt_ref, b, layer_ref[0], h, hi, geo.block_size, cfg.prefetch_pages)
        k_scale, v_scale = head_scales(scales_ref, layer_ref[0], h, geo)
        if segment:
            out = attend_in_segments(q, first_pos + t, src, lo, hi, first_pos, last_pos, window, block_n=cfg.block_n,
                                     scores=scores, segment=segment, k_scale=k_scale, v_scale=v_scale)
        else:
            acc, m, l = attend(q, first_pos + t, src, lo, hi, first_pos, last_pos, window,
                                block_n=cfg.block_n, scores=scores, k_scale=k_scale)
            out, _ = finish(acc, m, l, v_scale)
        store_rows(o_ref, tok, head, valid, tuple(0.0 + part for part in out))  # as the decode kernel's (-0.0 → 0.0)

    pl.when(b >= geo.num_seqs)(lambda: _zero_spare_tile(o_ref, q0, h, geo, cfg))


def _prefill_segment_kernel(layer_ref, window_ref, qsl_ref, lens_ref, bt_ref, tile_seq_ref, tile_q0_ref, q_ref, kv_ref,
                            scales_ref, o_ref, lse_ref, *, geo: Geometry, cfg: KernelConfig, split: SplitConfig,
                            scores: Scores):
    """Program (query tile i, KV head h, segment s): the tile's rows over the s-th absolute segment they can see,
    normalised, with their base-2 LSE (`_prefill_merge_kernel` folds them). The rows `attend_in_segments` would
    compute for that segment in one program walking them all: a short step's tiles over a long context spread
    over the segments instead of walking them in turn."""
    i, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b = tile_seq_ref[i]
    t, g = query_rows(cfg.block_m, geo.group, geo.group_pad)

    @pl.when(b < geo.num_seqs)
    def _():
        first_pos, last_pos, valid, tok, lo, hi = _tile_rows(qsl_ref, lens_ref, window_ref, b, tile_q0_ref[i], geo,
                                                             cfg)

        @pl.when(s < num_segments(lo, hi, split.fold))
        def _():
            head = jnp.where(valid, h * geo.group + g, 0)
            q = scores.operands(load_q(q_ref, tok, head, valid, geo.parts))
            src = KVSource(kv_ref, bt_ref, b, layer_ref[0], h, hi, geo.block_size, cfg.prefetch_pages)
            k_scale, v_scale = head_scales(scales_ref, layer_ref[0], h, geo)
            out, lse = segment_rows(q, first_pos + t, src, lo, hi, s, first_pos, last_pos, window_ref[0],
                                    block_n=cfg.block_n, scores=scores, segment=split.fold, k_scale=k_scale,
                                    v_scale=v_scale)
            _store_partial((o_ref, lse_ref), (i, h, s), valid, out, lse, geo, cfg)


def _prefill_merge_kernel(window_ref, qsl_ref, lens_ref, tile_seq_ref, tile_q0_ref, o_part_ref, lse_part_ref, o_ref, *,
                          geo: Geometry, cfg: KernelConfig, split: SplitConfig):
    """Program (query tile i, KV head h): the tile's segments folded in order, as `attend_in_segments` folds them
    (and the decode merge its splits), the rows stored; spare tiles zero the padding tokens' rows."""
    i, h = pl.program_id(0), pl.program_id(1)
    b, q0 = tile_seq_ref[i], tile_q0_ref[i]
    _, g = query_rows(cfg.block_m, geo.group, geo.group_pad)

    @pl.when(b < geo.num_seqs)
    def _():
        _, _, valid, tok, lo, hi = _tile_rows(qsl_ref, lens_ref, window_ref, b, q0, geo, cfg)
        out = _fold_splits(o_part_ref, lse_part_ref, (i, h), valid, num_segments(lo, hi, split.fold), geo, cfg)
        head = jnp.where(valid, h * geo.group + g, 0)
        store_rows(o_ref, tok, head, valid, (0.0 + out,))  # as the other kernels' stores (-0.0 → 0.0)

    pl.when(b >= geo.num_seqs)(lambda: _zero_spare_tile(o_ref, q0, h, geo, cfg))


# ---------------------------------------------------------------------------------------------------------------
# Host-side (XLA) glue: tile tables, launches, split merge.


def _scalars(layer, sliding_window):
    return jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(sliding_window, jnp.int32).reshape(1)


def _decode_call(q, kv_cache, scales, layer_window, qsl, lens, bt, geo, tuning, scores, interpret, *,
                 direct: bool = False, out=None):
    """Launches the split-K decode kernel: normalised partial outputs and their base-2 LSE per split; or, `direct`
    (every request's context fits one split), the rows themselves, no merge needed: into `out` in place (a
    prefill's output), or into a fresh output with the padding tokens' zeros (`out` None: a decode-only step)."""
    cfg, split = tuning.decode, tuning.split
    part_shape = (geo.num_seqs, geo.kv_heads, split.slots, cfg.block_m)
    if direct:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_shape = [jax.ShapeDtypeStruct((*part_shape, geo.head_dim), jnp.float32),
                     jax.ShapeDtypeStruct(part_shape, jnp.float32)]
    into = () if out is None else (out,)
    kernel = functools.partial(_decode_kernel, geo=geo, cfg=cfg, split=split, scores=scores, direct=direct,
                               fresh=direct and out is None)
    return pl.pallas_call(
        kernel,
        grid=(geo.num_seqs, geo.kv_heads, 1 if direct else split.max_splits),
        in_specs=[pl.no_block_spec] * (8 + len(into)),
        out_specs=pl.no_block_spec if direct else [pl.no_block_spec] * 2,
        out_shape=out_shape,
        input_output_aliases={8: 0} if into else {},
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="ragged_paged_attention_decode",
    )(*layer_window, qsl, lens, bt, q, kv_cache, scales, *into)


def _merge_call(q, out, partials, layer_window, qsl, lens, geo, tuning, interpret):
    """Merges the decode splits into `out` in place (rows of other requests untouched), or into a fresh output
    with the padding tokens' zeros (`out` None: a decode-only step)."""
    into = () if out is None else (out,)
    kernel = functools.partial(_merge_kernel, geo=geo, cfg=tuning.decode, split=tuning.split, fresh=out is None)
    return pl.pallas_call(
        kernel,
        grid=(geo.num_seqs, geo.kv_heads),
        in_specs=[pl.no_block_spec] * (5 + len(into)),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        input_output_aliases={5: 0} if into else {},
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="ragged_paged_attention_merge",
    )(layer_window[1], qsl, lens, *partials, *into)


def _prefill_tiles(qsl, geo: Geometry, tuning: Tuning, below: int | None = None):
    """Static-length table of query tiles: (request, first new-token index) per tile, heaviest (latest) tile of a
    request first; the spare tiles at the end get (num_seqs, first padding token to zero). Requests that fit the
    decode kernel get none, nor (`below`) those of at least that many new tokens."""
    tpt_dec = tokens_per_tile(geo, tuning.decode)
    tpt = tokens_per_tile(geo, tuning.prefill)
    num_tiles = cdiv(geo.num_tokens, tpt) + min(geo.num_seqs, geo.num_tokens // (tpt_dec + 1))
    q_len = qsl[1:] - qsl[:-1]
    served = (q_len > tpt_dec) if below is None else (q_len > tpt_dec) & (q_len < below)
    seq, from_last, spare = latest_first(jnp.where(served, cdiv(q_len, tpt), 0), num_tiles)
    q0 = jnp.where(seq < geo.num_seqs, from_last * tpt, qsl[-1] + spare * tpt)
    return num_tiles, seq, q0.astype(jnp.int32)


def _prefill_call(q, kv_cache, scales, layer_window, qsl, lens, bt, geo, tuning, scores, interpret, *, into=None,
                  below: int | None = None):
    """The Triton prefill kernel's rows and the padding's zeros: into a fresh output, or into `into` in place (the
    Mosaic kernel's output, whose requests of at least `below` new tokens it leaves alone)."""
    cfg = tuning.prefill
    num_tiles, tile_seq, tile_q0 = _prefill_tiles(qsl, geo, tuning, below)
    if tuning.segments_apart and _segment_partial_bytes(num_tiles, geo, tuning) <= MAX_SEGMENT_PARTIAL_BYTES:
        if into is not None:
            raise ValueError("the segment-parallel prefill writes a fresh output")
        return _prefill_segments_call(q, kv_cache, scales, layer_window, qsl, lens, bt, (num_tiles, tile_seq, tile_q0),
                                      geo, tuning, scores, interpret)
    into = () if into is None else (into,)
    segment = tuning.split.fold if tuning.split.absolute else None
    kernel = functools.partial(_prefill_kernel, geo=geo, cfg=cfg, scores=scores, segment=segment)
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, geo.kv_heads),
        in_specs=[pl.no_block_spec] * (10 + len(into)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        input_output_aliases={10: 0} if into else {},
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="ragged_paged_attention_prefill",
    )(*layer_window, qsl, lens, bt, tile_seq, tile_q0, q, kv_cache, scales, *into)


def _segment_partial_bytes(num_tiles: int, geo: Geometry, tuning: Tuning) -> int:
    """The float32 partial rows (and LSEs) a segment-parallel prefill writes for a step's static shapes."""
    return num_tiles * geo.kv_heads * tuning.split.slots * tuning.prefill.block_m * (geo.head_dim + 1) * 4


def _prefill_segments_call(q, kv_cache, scales, layer_window, qsl, lens, bt, tiles, geo, tuning, scores, interpret):
    """The batch-invariant prefill with a program per (tile, KV head, segment), then the fold of the segments
    (`Tuning.segments_apart`): the rows of the one-program walk (`_prefill_kernel` with a segment), bit for bit."""
    cfg, split = tuning.prefill, tuning.split
    num_tiles, tile_seq, tile_q0 = tiles
    part_shape = (num_tiles, geo.kv_heads, split.slots, cfg.block_m)
    params = pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    partials = pl.pallas_call(
        functools.partial(_prefill_segment_kernel, geo=geo, cfg=cfg, split=split, scores=scores),
        grid=(num_tiles, geo.kv_heads, split.slots),
        in_specs=[pl.no_block_spec] * 10,
        out_specs=[pl.no_block_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct((*part_shape, geo.head_dim), jnp.float32),
                   jax.ShapeDtypeStruct(part_shape, jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="ragged_paged_attention_prefill_segments",
    )(*layer_window, qsl, lens, bt, tile_seq, tile_q0, q, kv_cache, scales)
    return pl.pallas_call(
        functools.partial(_prefill_merge_kernel, geo=geo, cfg=cfg, split=split),
        grid=(num_tiles, geo.kv_heads),
        in_specs=[pl.no_block_spec] * 7,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="ragged_paged_attention_prefill_merge",
    )(layer_window[1], qsl, lens, tile_seq, tile_q0, *partials)


def _prefill(args, *, mosaic: bool):
    """The prefill launches of a step: the Triton kernel alone, or the Mosaic kernel for the requests of at least
    `mosaic_prefill.ROWS_PER_GROUP` new tokens and the Triton kernel into its output for the others."""
    if not mosaic:
        return _prefill_call(*args)
    q, kv_cache, _, (layer, window), qsl, lens, bt, _, tuning, scores, interpret = args
    out = mosaic_prefill.mosaic_prefill(
        q, kv_cache, layer[0], qsl, lens, bt, scale=scores.scale, sliding_window=window[0], soft_cap=scores.soft_cap,
        config=tuning.mosaic_prefill, interpret=plgpu.InterpretGPUParams() if interpret else None)
    return _prefill_call(*args, into=out, below=mosaic_prefill.ROWS_PER_GROUP)


def _mosaic_decode_rows(q, kv_cache, kv_scales, layer_window, qsl, lens, bt, scale, config, interpret):
    """A decode-only step on the Mosaic GPU decode: each request's one new token (a request with none attends to
    nothing), its row written where the request's token sits, padding tokens' rows zero."""
    num_tokens = q.shape[0]
    first, has_token = qsl[:-1], qsl[1:] > qsl[:-1]
    out = mosaic_decode.mosaic_decode(
        q[jnp.minimum(first, num_tokens - 1)], kv_cache, layer_window[0][0], jnp.where(has_token, lens, 0), bt,
        scale=float(scale), sliding_window=layer_window[1][0], kv_scales=kv_scales, config=config,
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    return jnp.zeros_like(q).at[jnp.where(has_token, first, num_tokens)].set(out, mode="drop")


def merge_free(table_positions: int, split: SplitConfig) -> bool:
    """Whether a step's decodes need no merge: a request's context is at most its block table's positions, and
    when those fit one split, no request has more than one (nor with one split at most)."""
    return split.max_splits == 1 or table_positions <= split.split_tokens


def decode_only_start(q: Array) -> Array | None:
    """What a decode-only step's output starts as: nothing, since its last launch writes every row, the padding's
    zeros too (benchmarks patch in `jnp.zeros_like(q)`, updated in place, for the A/B)."""
    del q
    return None


def ragged_paged_attention_impl(
    q, kv_cache, layer, query_start_loc, seq_lens, block_tables, *, scale, sliding_window, soft_cap, max_query_len,
    interpret, tuning: Tuning | None = None, kv_scales: KVScales | None = None, single_path: bool = False,
    invariant_segment: int | None = None, invariant_split: int | None = None, parallel_short_segments: bool = False,
):
    """The body of `ragged_paged_attention` with the block sizes as an argument (benchmarks sweep them)."""
    num_tokens, q_heads, head_dim = q.shape
    _, _, block_size, _, kv_heads, _ = kv_cache.shape
    check_supported(head_dim=head_dim, block_size=block_size, num_q_heads=q_heads, num_kv_heads=kv_heads)
    check_kv_scales(kv_cache.shape, kv_cache.dtype, kv_scales)
    quantized = kv_scales is not None
    cache_as_stored = kv_cache
    if quantized:
        kv_cache = as_byte_pairs(kv_cache)  # 2-byte elements: addressable at any size (addressing.py)
    scales = kv_scales.astype(jnp.float32).reshape(-1) if quantized else jnp.ones((1,), jnp.float32)
    geo = Geometry(num_tokens, seq_lens.shape[0], q_heads, kv_heads, head_dim, block_size, quantized)
    if tuning is None:
        tuning = default_tuning(head_dim, geo.group, quantized, hopper=not interpret and mosaic_prefill.on_hopper())
    if invariant_segment:
        tuning = dataclasses.replace(tuning, invariant_segment=invariant_segment, invariant_split=invariant_split)
    if parallel_short_segments:
        tuning = dataclasses.replace(tuning, parallel_short_segments=True)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scores = Scores(float(scale), float(soft_cap) if soft_cap else None, precision,  # float32 queries stay float32
                    float16_operands=quantized and tuning.fp8_operands == "float16" and q.dtype != jnp.float32)
    qsl, lens, bt = (jnp.asarray(a, jnp.int32) for a in (query_start_loc, seq_lens, block_tables))
    layer_window = _scalars(layer, sliding_window)
    if single_path:
        tuning = tuning.batch_invariant(max_query_len, geo.group_pad, bt.shape[1] * block_size)
        scores = dataclasses.replace(scores, sums_by_mma=True)
    if (tuning.mosaic_decode is not None and max_query_len == 1 and not single_path and scores.soft_cap is None
            and q.dtype != jnp.float32 and mosaic_decode.supports(
                q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                dtype=cache_as_stored.dtype, config=tuning.mosaic_decode)):
        return _mosaic_decode_rows(q, cache_as_stored, kv_scales, layer_window, qsl, lens, bt, scale,
                                   tuning.mosaic_decode, interpret)
    args = (q, kv_cache, scales, layer_window, qsl, lens, bt, geo, tuning, scores, interpret)
    direct = merge_free(bt.shape[1] * block_size, tuning.split)
    partials = None if direct else _decode_call(*args)
    decode_only = max_query_len <= tokens_per_tile(geo, tuning.decode)  # no prefill launch
    mosaic = (tuning.mosaic_prefill is not None and not single_path and mosaic_prefill.supports(
        dtype=q.dtype, head_dim=head_dim, block_size=block_size, quantized=quantized, max_query_len=max_query_len,
        config=tuning.mosaic_prefill))
    out = decode_only_start(q) if decode_only else _prefill(args, mosaic=mosaic)
    if direct:
        return _decode_call(*args, direct=True, out=out)
    return _merge_call(q, out, partials, layer_window, qsl, lens, geo, tuning, interpret)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "max_query_len", "interpret", "single_path",
                                             "invariant_segment", "invariant_split", "parallel_short_segments"))
def ragged_paged_attention(
    q: Float[Array, "tokens q_heads head_dim"],
    kv_cache: KVCache,
    layer: Int[Array, ""] | int,
    query_start_loc: Int[Array, " seqs_plus_1"],
    seq_lens: Int[Array, " seqs"],
    block_tables: Int[Array, "seqs blocks_per_seq"],
    *,
    kv_scales: KVScales | None = None,
    scale: float,
    sliding_window: Int[Array, ""] | int = 0,
    soft_cap: float | None = None,
    max_query_len: int,
    interpret: bool = False,
    single_path: bool = False,
    invariant_segment: int | None = None,
    invariant_split: int | None = None,
    parallel_short_segments: bool = False,
) -> Float[Array, "tokens q_heads head_dim"]:
    """Attention of every new token over its own request's cached positions (this step's K/V already written).

    `kv_scales` (float32 `[layers, 2, kv_heads]`, required for and only for a float8_e4m3fn cache): real K/V =
    stored value × scale of its layer, K or V, and KV head. `sliding_window` > 0 keeps the last `sliding_window`
    positions (traced: it may differ per scanned layer); `soft_cap` applies `cap * tanh(s / cap)` to the scaled
    logits; `max_query_len` is the static bound on new tokens per request (a bucket). Rows of padding tokens (after
    `query_start_loc[-1]`) are zeros. Raises `UnsupportedShapeError` for head dims or block sizes the kernel does
    not handle; ValueError for missing or misshaped scales.

    `single_path` (the batch-invariant mode): every row adds up the same KV tiles in the same order whichever
    kernel serves it, so a prompt whose last chunk is short (a prefix-cache hit, a chunk budget) rounds its logits
    as the same prompt in one piece does (`Tuning.batch_invariant`: the decode kernel in one split, over tiles as
    wide as the prefill kernel's, row sums on the tensor cores in both; small prefill tiles for a short step). By
    default a request with a few new tokens goes to the split-K decode kernel, whose splits follow its own length.
    `invariant_segment` (with `single_path`; `Tuning.invariant_segment`): long contexts cut at the multiples of
    this many positions, each segment's rows a partial result folded in order by every kernel alike;
    `invariant_split` (a multiple of it; default the segment): the positions one decode program walks;
    `parallel_short_segments`: a short step's segments on programs of their own (`Tuning.segments_apart`).
    """
    return ragged_paged_attention_impl(
        q, kv_cache, layer, query_start_loc, seq_lens, block_tables, scale=scale, sliding_window=sliding_window,
        soft_cap=soft_cap, max_query_len=max_query_len, interpret=interpret, kv_scales=kv_scales,
        single_path=single_path, invariant_segment=invariant_segment, invariant_split=invariant_split,
        parallel_short_segments=parallel_short_segments,
    )
