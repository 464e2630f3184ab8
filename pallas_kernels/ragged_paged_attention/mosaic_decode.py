"""Decode attention on Hopper (Pallas, Mosaic GPU): block-table-chosen pages TMA-loaded into a ring, wgmma scores.

The Triton decode kernel reads a bf16 cache at ~0.95 of the copy bandwidth while cuDNN reads a contiguous cache of
the same bytes faster (`benchmarks/README.md` "kernels"): its loop waits on its block-table-addressed loads. Here a
program owns one (sequence, KV head, split of `MosaicDecodeConfig.split` positions) and keeps `slots - 1` steps of
pages in flight through TMA while it computes on the current one, so the page indirection costs only the block-table
reads that pick each copy's source.

A program's query rows are its KV head's group of query heads (GQA: 4 for Llama-3-8B), the left operand (in
registers) of a 64-row wgmma: the 64 rows from the group's first head are loaded (the array is padded by 64 rows at
its end), rows past the group are other heads' queries whose scores and outputs are computed and never stored (rows
are independent through a row-wise softmax). Each step: S = Q Kᵀ by wgmma, the online softmax in registers (base
2, running max in raw logits), O += P V by wgmma; the last step's positions past the sequence's length masked and
its V rows past the length zeroed (a page's unwritten tail may hold NaN). A program stores its group's
unnormalised rows and their (max, sum) in float32, staged through shared memory the ring's scope has released; one
XLA fusion merges the splits. Only the ring stays in shared memory through the walk, so programs with small rings
share an SM.

bf16, float16 and float8 caches (each step's float8 pages widened to float16 in shared memory), sliding windows
(traced, as the layers pass them); no soft cap (the Triton kernels serve it).
`scripts/bench_kernels.py --only peers` times it beside the Triton decode and cuDNN on a contiguous cache.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.ragged_paged_attention.mosaic_prefill import LOG2E, M_INIT, zero_unowned_values
from pallas_kernels.ragged_paged_attention.tiles import cdiv
from pallas_kernels.ragged_paged_attention.tuning import MosaicDecodeConfig
from pallas_kernels.swizzle import swizzled

ROWS = 64  # wgmma rows: a program's query heads, padded
CACHE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float8_e4m3fn))
QUERY_SHIFT = 4  # a float8 cache: the query enters float16 scaled by 2^-4 (|q| up to 1e6 fits), the scores × 2^4
STAT_COLUMNS = 8  # a row's (max, sum) stored as an 8-column tile (the narrowest wgmma-layout tile): column 0, 1


@dataclasses.dataclass(frozen=True)
class _Geometry:
    num_seqs: int
    table_width: int
    block_size: int
    kv_heads: int
    group: int
    head_dim: int
    config: MosaicDecodeConfig
    scale: float
    dtype: jnp.dtype  # the cache's
    # Q and P through shared memory (Mosaic GPU's interpreter: its wgmma takes shared-memory operands only)
    staged: bool

    @property
    def quantized(self) -> bool:
        return self.dtype == jnp.dtype(jnp.float8_e4m3fn)

    @property
    def compute(self) -> jnp.dtype:
        """The tensor cores' operands: the cache's dtype, or float16 for float8 (e4m3 widens to float16 only)."""
        return jnp.dtype(jnp.float16) if self.quantized else self.dtype

    @property
    def pages_per_step(self) -> int:
        return self.config.block_kv // self.block_size


@dataclasses.dataclass(frozen=True)
class _Meta:
    """The integer inputs as one buffer (Mosaic GPU takes 256-byte-aligned operands only): [page base, window, layer,
    sequence lengths, block tables (row-major)]."""

    ref: object
    num_seqs: int
    table_width: int

    @staticmethod
    def pack(page_base, window, layer, seq_lens, block_tables) -> Int[Array, " n"]:
        parts = (page_base, window, layer, seq_lens, block_tables)
        return jnp.concatenate([jnp.asarray(x, jnp.int32).reshape(-1) for x in parts])

    @property
    def page_base(self):
        return self.ref[0]

    @property
    def window(self):
        return self.ref[1]

    @property
    def layer(self):
        return self.ref[2]

    def seq_len(self, seq):
        return self.ref[3 + seq]

    def block(self, seq, column):
        return self.ref[3 + self.num_seqs + seq * self.table_width + column]


def check(*, q_heads: int, kv_heads: int, head_dim: int, block_size: int, dtype,
          config: MosaicDecodeConfig) -> None:
    if jnp.dtype(dtype) not in CACHE_DTYPES:
        raise ValueError(f"the Mosaic GPU decode reads bfloat16, float16 or float8_e4m3fn caches, not {dtype}")
    group = q_heads // kv_heads
    if q_heads % kv_heads or group > ROWS:
        raise ValueError(f"{q_heads} query heads over {kv_heads} KV heads: whole groups of at most {ROWS} heads")
    if (config.block_kv % block_size or config.block_kv % 64 or config.split % config.block_kv
            or head_dim % 64 or config.slots < 2):
        raise ValueError(f"{config}: steps of whole pages ({block_size} positions) and of a multiple of 64, splits of "
                         f"whole steps, head_dim ({head_dim}) a multiple of 64, at least two slots")


def supports(*, q_heads: int, kv_heads: int, head_dim: int, block_size: int, dtype,
             config: MosaicDecodeConfig) -> bool:
    """Whether `check` passes (static facts only)."""
    try:
        check(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
              config=config)
    except ValueError:
        return False
    return True


def mosaic_decode(
    q: Float[Array, "seqs q_heads head_dim"],
    kv_cache: Float[Array, "layers blocks block_size 2 kv_heads head_dim"],
    layer: Int[Array, ""] | int,
    seq_lens: Int[Array, " seqs"],
    block_tables: Int[Array, "seqs blocks_per_seq"],
    *,
    scale: float,
    sliding_window: Int[Array, ""] | int = 0,
    kv_scales: Float[Array, "layers 2 kv_heads"] | None = None,
    config: MosaicDecodeConfig = MosaicDecodeConfig(),
    interpret=None,
) -> Float[Array, "seqs q_heads head_dim"]:
    """One new token per sequence attending to its `seq_lens` positions of the paged cache (its own K/V already
    written); `sliding_window` > 0 keeps the last that many (traced). A sequence of length 0 gets zeros.
    `kv_scales` (a float8 cache's, required with one): real K/V = stored × scale of (layer, K or V, KV head); each
    step's pages widen to float16 in shared memory for the tensor cores. `interpret`: Mosaic GPU's interpreter
    parameters (`plgpu.InterpretGPUParams`), for the CPU."""
    num_seqs, q_heads, head_dim = q.shape
    layers, blocks, block_size, _, kv_heads, _ = kv_cache.shape
    table_width = block_tables.shape[1]
    check(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=kv_cache.dtype,
          config=config)
    geo = _Geometry(num_seqs, table_width, block_size, kv_heads, q_heads // kv_heads, head_dim, config, float(scale),
                    jnp.dtype(kv_cache.dtype), interpret is not None)
    if geo.quantized != (kv_scales is not None):
        raise ValueError("kv_scales go with a float8_e4m3fn cache, and only with one")
    scales = (kv_scales if geo.quantized else jnp.ones((layers, 2, kv_heads), jnp.float32)).astype(jnp.float32)
    splits = cdiv(table_width * block_size, config.split)
    rows = num_seqs * q_heads
    pages = kv_cache.reshape(layers * blocks, block_size, 2 * kv_heads, head_dim)  # a free reshape
    q_rows = q.reshape(rows, head_dim)
    if geo.quantized:
        q_rows = q_rows.astype(jnp.float32) * 2.0 ** -QUERY_SHIFT
    q_rows = jnp.concatenate([q_rows.astype(geo.compute), jnp.zeros((ROWS, head_dim), geo.compute)])
    kernel = plgpu.kernel(
        functools.partial(_program, geo=geo),
        out_type=(jax.ShapeDtypeStruct((splits, rows, head_dim), jnp.float32),
                  jax.ShapeDtypeStruct((splits, rows, STAT_COLUMNS), jnp.float32)),
        grid=(num_seqs, kv_heads, splits),
        grid_names=("seq", "head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    meta = _Meta.pack(layer * blocks, jnp.asarray(sliding_window).reshape(1), layer, seq_lens, block_tables)
    acc, stats = kernel(meta, q_rows, pages, scales)
    return merge(acc, stats).reshape(q.shape).astype(q.dtype)


def merge(acc: Float[Array, "splits rows d"], stats: Float[Array, "splits rows c"]) -> Float[Array, "rows d"]:
    """The splits' unnormalised rows and (max, sum) into each row's softmax-weighted output (0 for a row with no
    positions); the maxima in base-2 units of the scaled scores."""
    m, l = stats[..., 0], stats[..., 1]
    top = jnp.max(m, axis=0)
    weight = jnp.exp2(m - top[None])
    total = jnp.sum(weight * l, axis=0)
    out = jnp.sum(weight[..., None] * acc, axis=0)
    return jnp.where(total[:, None] > 0, out / jnp.where(total > 0, total, 1.0)[:, None], 0.0)


def _smem(shape: tuple[int, ...], dtype) -> plgpu.SMEM:
    return plgpu.SMEM(shape, dtype, transforms=swizzled(dtype, shape[-1]))


def _program(meta_ref, q_ref, pages_ref, scales_ref, acc_ref, stats_ref, *, geo: _Geometry):
    """The walk in one shared-memory scope (K/V ring, barriers), the store in the next: sequential scopes reuse the
    same bytes, so the float32 output staging does not add to the ring's footprint; the query stays in registers as
    the scores' wgmma operand. At the defaults a program then takes under half an SM's shared memory (two share an
    SM, one filling its ring while the other computes). The interpreter's wgmma takes shared-memory operands only,
    so there Q and P are staged through shared memory."""
    ring = (geo.config.slots, geo.config.block_kv, geo.head_dim)
    tile = (geo.config.block_kv, geo.head_dim)
    buffers = [_smem(ring, geo.dtype), _smem(ring, geo.dtype)]
    extra = ([_smem(tile, geo.compute), _smem(tile, geo.compute)] if geo.quantized else []) + (
        [_smem((ROWS, geo.head_dim), geo.compute), _smem((ROWS, geo.config.block_kv), geo.compute)]
        if geo.staged else [])
    meta = _Meta(meta_ref, geo.num_seqs, geo.table_width)

    def walk_scope(k_smem, v_smem, *rest):
        wide = rest[:2] if geo.quantized else None  # the step's K and V widened to float16
        q_smem, p_smem = rest[len(extra) - 2:len(extra)] if geo.staged else (None, None)
        k_ready, v_ready = rest[-2:]
        return _walk(meta, q_ref, pages_ref, scales_ref, q_smem, k_smem, v_smem, p_smem, wide, k_ready, v_ready,
                     geo=geo)

    acc, m, l = pl.run_scoped(walk_scope, *buffers, *extra,
                              plgpu.Barrier(num_arrivals=geo.pages_per_step, num_barriers=geo.config.slots),  # K
                              plgpu.Barrier(num_arrivals=geo.pages_per_step, num_barriers=geo.config.slots))  # V
    split, rows = lax.axis_index("split"), pl.ds(_first_row(geo), geo.group)
    pl.run_scoped(lambda o_smem, s_smem: _store(acc, m, l, o_smem, s_smem, acc_ref.at[split, rows],
                                                stats_ref.at[split, rows], geo.group),
                  plgpu.SMEM((ROWS, geo.head_dim), jnp.float32), plgpu.SMEM((ROWS, STAT_COLUMNS), jnp.float32))


def _first_row(geo: _Geometry):
    """The program's first query row: its KV head's group's first head, in row-major (sequence, head) order."""
    return (lax.axis_index("seq") * geo.kv_heads + lax.axis_index("head")) * geo.group


def _walk(meta: _Meta, q_ref, pages_ref, scales_ref, q_smem, k_smem, v_smem, p_smem, wide, k_ready, v_ready, *,
          geo: _Geometry):
    """The program's steps; returns its group's unnormalised rows, their maxima (base-2 units) and sums."""
    seq, kv_head, split = lax.axis_index("seq"), lax.axis_index("head"), lax.axis_index("split")
    cfg = geo.config
    seq_len, window = meta.seq_len(seq), meta.window
    start = split * cfg.split
    # the split's visible positions [lo, hi), counted from its start: before the sequence's end, inside the window
    hi = jnp.clip(seq_len - start, 0, cfg.split)
    lo = jnp.where(window > 0, jnp.clip(seq_len - window - start, 0, hi), 0)
    first = lax.div(lo, cfg.block_kv)
    end = jnp.where(lo < hi, cdiv(hi, cfg.block_kv), first)
    q = plgpu.load(q_ref.at[pl.ds(_first_row(geo), ROWS)], layout=plgpu.Layout.WGMMA, optimized=False)
    if q_smem is not None:
        q_smem[...] = q
        plgpu.commit_smem()
        q = q_smem

    def slot_of(step):
        return lax.rem(step - first, cfg.slots)

    def page_ids(step) -> tuple:
        """Step `step`'s pages in the flat cache (columns past the table clamped: read, never loaded)."""
        column0 = start // geo.block_size + step * geo.pages_per_step
        return tuple(meta.page_base + jnp.maximum(meta.block(seq, jnp.minimum(column0 + j, geo.table_width - 1)), 0)
                     for j in range(geo.pages_per_step))

    def issue(step, pages: tuple | None = None):
        """TMA-loads step `step`'s pages (`pages`: their ids, read earlier) into its ring slot."""
        slot = slot_of(step)
        for j, page in enumerate(page_ids(step) if pages is None else pages):
            rows = pl.ds(j * geo.block_size, geo.block_size)
            plgpu.copy_gmem_to_smem(pages_ref.at[page, :, kv_head], k_smem.at[slot, rows], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(pages_ref.at[page, :, geo.kv_heads + kv_head], v_smem.at[slot, rows],
                                    v_ready.at[slot])

    for i in range(cfg.slots - 1):
        pl.when(first + i < end)(functools.partial(issue, first + i))

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m = plgpu.layout_cast(jnp.full((ROWS,), M_INIT, jnp.float32), row_layout)
    l = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), row_layout)
    acc = plgpu.layout_cast(jnp.zeros((ROWS, geo.head_dim), jnp.float32), plgpu.Layout.WGMMA)
    c2 = geo.scale * LOG2E  # raw scores to base-2 exponents
    if geo.quantized:
        c2 = c2 * 2.0 ** QUERY_SHIFT * scales_ref[meta.layer, 0, kv_head]

    def operand(ring, slot, index: int):
        """The step's K or V tile as the tensor cores take it: the ring slot, or (float8) its float16 widening."""
        if wide is None:
            return ring.at[slot]
        wide[index][...] = ring.at[slot][...].astype(geo.compute)
        plgpu.commit_smem()
        return wide[index]

    def step_body(step, carry, masked: bool):
        acc, m, l, pages = carry
        # the slot the next load takes held step - 1, whose products were awaited before this step began
        pl.when(step + cfg.slots - 1 < end)(lambda: issue(step + cfg.slots - 1, pages if cfg.prefetch_pages else None))
        if cfg.prefetch_pages:  # the next load's page ids, read while this step computes
            pages = page_ids(step + cfg.slots)
        slot = slot_of(step)
        plgpu.barrier_wait(k_ready.at[slot])

        k_tile = operand(k_smem, slot, 0)

        def scores(acc_ref):
            plgpu.wgmma(acc_ref, q, k_tile.transpose((1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((ROWS, cfg.block_kv), jnp.float32))
        owned = hi - step * cfg.block_kv  # this step's positions before the sequence's end
        if masked:  # a window's lower edge, the sequence's end
            c = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
            s = jnp.where((c < owned) & (c >= lo - step * cfg.block_kv), s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2((m - m_new) * c2)
        p = jnp.exp2(s * c2 - lax.broadcast_in_dim(m_new * c2, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        plgpu.barrier_wait(v_ready.at[slot])
        v_tile = operand(v_smem, slot, 1)
        if masked:
            zero_unowned_values(v_tile, owned)
        p = p.astype(geo.compute)
        if p_smem is None:  # P from registers, accumulated into the carried registers
            acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p, v_tile))(plgpu.ACC.init(acc))
        else:
            p_smem[...] = p
            plgpu.commit_smem()

            def fresh(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_tile)
                return acc_ref[...]

            acc = acc + pl.run_scoped(fresh, plgpu.ACC((ROWS, geo.head_dim), jnp.float32))
        return acc, m_new, l, pages

    # masked steps [first, whole_from) and [whole_to, end), every position visible in [whole_from, whole_to)
    whole_from = jnp.minimum(first + (lax.rem(lo, cfg.block_kv) != 0).astype(jnp.int32), end)
    whole_to = jnp.clip(end - (lax.rem(hi, cfg.block_kv) != 0).astype(jnp.int32), whole_from, end)
    pages = page_ids(first + cfg.slots - 1) if cfg.prefetch_pages else ()
    carry = lax.fori_loop(first, whole_from, functools.partial(step_body, masked=True), (acc, m, l, pages))
    carry = lax.fori_loop(whole_from, whole_to, functools.partial(step_body, masked=False), carry)
    acc, m, l, _ = lax.fori_loop(whole_to, end, functools.partial(step_body, masked=True), carry)
    if geo.quantized:
        acc = acc * scales_ref[meta.layer, 1, kv_head]
    return acc, m * c2, l


def _store(acc, m, l, o_smem, s_smem, acc_out, stats_out, group: int) -> None:
    """The group's rows of the unnormalised output and of (max, sum), through shared memory and one TMA copy each."""
    o_smem[...] = acc
    column = plgpu.broadcasted_iota(jnp.int32, (ROWS, STAT_COLUMNS), 1, layout=plgpu.Layout.WGMMA)
    s_smem[...] = jnp.where(column == 0, lax.broadcast_in_dim(m, column.shape, [0]),
                            lax.broadcast_in_dim(l, column.shape, [0]))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], acc_out)
    plgpu.copy_smem_to_gmem(s_smem.at[pl.ds(0, group)], stats_out)
    plgpu.wait_smem_to_gmem(0)
