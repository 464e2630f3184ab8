"""The prefill kernel on Hopper's tensor-core pipeline (Pallas, Mosaic GPU backend): wgmma over TMA-loaded pages.

Same semantics as the Triton prefill kernel in `kernel.py` for the requests it serves: each new token attends
causally over its request's cached positions (optionally only the last `sliding_window`), read page by page through
the block table, with an optional logit soft cap. It serves requests with at least `ROWS_PER_GROUP` new tokens in a
16-bit cache; `kernel.py` routes the rest to its Triton kernels, which then write their rows into this kernel's output
in place.

A work item is one query head × one tile of up to `2 × ROWS_PER_GROUP` consecutive new tokens of one request; a
program (CUDA block) takes one item, or (`MosaicConfig.persistent`) one program an SM takes items in turn. Three
warpgroups:
  * a producer warpgroup walks the tile's visible KV in steps of `block_kv` positions, TMA-loading each step's K and
    V pages (`block_kv / block_size` copies each, all counted on one barrier) into a ring of
    `max_concurrent_steps` shared-memory slots;
  * two compute warpgroups each own `ROWS_PER_GROUP` query rows: S = Q Kᵀ by wgmma, the online softmax in registers
    (base 2), O += P V by wgmma with P from registers, then the rows normalised and stored. They take turns on
    the tensor cores through a shared barrier (one's softmax overlaps the other's matmuls). Steps every row of a
    group sees whole run unmasked; the causal edge (and a window's lower edge) are masked by position.
A tile's rows never cross its request's end: the last group of a request is shifted back to end on its last token,
so it may recompute rows of the group before it (the same bits: a fully visible step gives the same numbers masked
or not, a fully masked one leaves a row unchanged), and every store lands inside its own request.

Why a second backend: Triton's lowering caps the prefill at about 276 TFLOP/s on an H100 (4k causal), beside
XLA's ~690 TFLOP/s matmuls; warp specialisation, TMA and wgmma with register-held P is how FA3-class kernels reach
the tensor cores' rate (this one: 447-453 TFLOP/s on an H100, `benchmarks/README.md`). Not used in the
batch-invariant mode, whose rows must match the Triton decode kernel's bits.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.ragged_paged_attention.tiles import cdiv, latest_first
from pallas_kernels.ragged_paged_attention.tuning import MosaicConfig

ROWS_PER_GROUP = 64  # one warpgroup's wgmma rows
COMPUTE_GROUPS = 2
ROWS_PER_TILE = ROWS_PER_GROUP * COMPUTE_GROUPS
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
LOG2E = math.log2(math.e)
M_INIT = -1e30  # finite running max: a row's first steps may be wholly masked at no risk of inf - inf
INTERPRET_PROGRAMS = 3  # persistent programs in the interpreter: several items each


def supports(*, dtype, head_dim: int, block_size: int, quantized: bool, max_query_len: int,
             config: MosaicConfig = MosaicConfig()) -> bool:
    """Whether a step's long requests can take this kernel (static facts only)."""
    return (jnp.dtype(dtype) in SUPPORTED_DTYPES and head_dim in (64, 128) and not quantized
            and max_query_len >= ROWS_PER_GROUP and config.block_kv % max(block_size, 64) == 0)


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (sm_90: wgmma; Blackwell's tensor cores take other instructions)."""
    return getattr(jax.devices()[0], "compute_capability", None) == "9.0"


def tile_table(qsl: Int[Array, " seqs_plus_1"], num_tokens: int) -> tuple[int, Array, Array]:
    """Static-length table of (request, first new-token index) per tile for the requests of at least
    `ROWS_PER_GROUP` new tokens, a request's latest (heaviest) tile first; spare tiles get request `num_seqs`."""
    num_seqs = qsl.shape[0] - 1
    num_tiles = max(1, cdiv(num_tokens, ROWS_PER_TILE) + min(num_seqs, num_tokens // ROWS_PER_GROUP))
    q_len = qsl[1:] - qsl[:-1]
    seq, from_last, _ = latest_first(jnp.where(q_len >= ROWS_PER_GROUP, cdiv(q_len, ROWS_PER_TILE), 0), num_tiles)
    q0 = jnp.where(seq < num_seqs, from_last * ROWS_PER_TILE, 0)
    return num_tiles, seq, q0.astype(jnp.int32)


def mosaic_prefill(
    q: Float[Array, "tokens q_heads head_dim"],
    kv_cache: Float[Array, "layers blocks block_size 2 kv_heads head_dim"],
    layer: Int[Array, ""],
    query_start_loc: Int[Array, " seqs_plus_1"],
    seq_lens: Int[Array, " seqs"],
    block_tables: Int[Array, "seqs blocks_per_seq"],
    *,
    scale: float,
    sliding_window: Int[Array, ""] | int = 0,
    soft_cap: float | None = None,
    config: MosaicConfig = MosaicConfig(),
    interpret=None,
) -> Float[Array, "tokens q_heads head_dim"]:
    """The rows of the requests with at least `ROWS_PER_GROUP` new tokens; every other row is left unwritten (the
    Triton kernels fill them in place). `sliding_window` > 0 keeps each row's last that many positions (traced);
    `soft_cap` applies `cap · tanh(s / cap)` to the scaled logits.
    `interpret`: Mosaic GPU's interpreter parameters (`plgpu.InterpretGPUParams`), for the CPU."""
    num_tokens, q_heads, head_dim = q.shape
    layers, blocks, block_size, _, kv_heads, _ = kv_cache.shape
    num_seqs, table_width = block_tables.shape
    group = q_heads // kv_heads
    # [layer × block, position, K/V × KV head, dim]: a page's K (or V) of one head is one 2-D TMA box; a free reshape
    pages = kv_cache.reshape(layers * blocks, block_size, 2 * kv_heads, head_dim)
    num_tiles, tile_seq, tile_q0 = tile_table(query_start_loc, num_tokens)
    geometry = _Geometry(num_seqs, table_width, block_size, kv_heads, group, head_dim, config.block_kv,
                         config.max_concurrent_steps, float(scale), float(soft_cap) if soft_cap else None, q.dtype,
                         interpret is not None or config.staged_pv)
    work = q_heads * num_tiles
    if config.persistent:
        programs = min(work, INTERPRET_PROGRAMS if interpret is not None else jax.devices()[0].core_count)
    else:
        programs = work
    plan = _Plan(q_heads, num_tiles, programs)
    kernel = plgpu.kernel(
        functools.partial(_program, geo=geometry, plan=plan),
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(programs,),
        grid_names=("program",),
        num_threads=COMPUTE_GROUPS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    meta = _Meta.pack(jnp.asarray(layer, jnp.int32) * blocks, sliding_window, query_start_loc, seq_lens, block_tables,
                      tile_seq, tile_q0)
    return kernel(meta, q, pages)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    num_seqs: int
    table_width: int
    block_size: int
    kv_heads: int
    group: int
    head_dim: int
    block_kv: int
    slots: int
    scale: float
    soft_cap: float | None
    dtype: jnp.dtype
    # P through shared memory and each step's P V into a fresh accumulator, then added in registers: the form Mosaic
    # GPU's interpreter runs (its wgmma takes operands from shared memory only and cannot seed an accumulator), and
    # `MosaicConfig.staged_pv` on the GPU
    staged_pv: bool

    def logits(self, s):
        """The scores the running max is kept in: raw (the scale folds into `exponents`), or soft-capped, scaled and
        times log2(e)."""
        if self.soft_cap is None:
            return s
        return jnp.tanh(s * (self.scale / self.soft_cap)) * (self.soft_cap * LOG2E)

    def exponents(self, s, m):
        """One online-softmax step in base 2 over `logits`: the new running max, the factor the old sums scale by,
        and P. Raw logits take their scale times log2(e) in one multiply-add a score with the max."""
        m_new = jnp.maximum(m, s.max(axis=1))
        if self.soft_cap is not None:  # already in base 2
            return m_new, jnp.exp2(m - m_new), jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        c = self.scale * LOG2E
        p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new * c, s.shape, [0]))
        return m_new, jnp.exp2((m - m_new) * c), p

    @property
    def pages_per_step(self) -> int:
        return self.block_kv // self.block_size


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Which (head, tile) items each program takes: item w is tile w // q_heads of head w % q_heads (a tile's heads
    side by side, the tile table's heaviest tiles first). Program p takes one item a round, rounds in alternating
    directions (p, then programs - 1 - p, ...), so the heavy and the light items even out across programs."""

    q_heads: int
    num_tiles: int
    programs: int

    @property
    def rounds(self) -> int:
        return cdiv(self.q_heads * self.num_tiles, self.programs)

    def item(self, program, r):
        """(valid, head, tile) of program `program`'s round `r`."""
        lane = jnp.where(lax.rem(r, 2) == 0, program, self.programs - 1 - program)
        w = r * self.programs + lane
        valid = w < self.q_heads * self.num_tiles
        return valid, lax.rem(w, self.q_heads), jnp.minimum(lax.div(w, self.q_heads), self.num_tiles - 1)


@dataclasses.dataclass(frozen=True)
class _Meta:
    """The kernel's integer inputs as one operand, and its reads: [page base, window, query_start_loc, seq_lens,
    block table (row-major), tile_seq, tile_q0]."""

    ref: object
    num_seqs: int
    table_width: int
    num_tiles: int

    @staticmethod
    def pack(page_base, window, query_start_loc, seq_lens, block_tables, tile_seq, tile_q0) -> Int[Array, " n"]:
        """One fresh buffer: Mosaic GPU takes only 256-byte-aligned operands, and XLA may hand a kernel a slice of a
        packed step input (`runner/host_pack.py`) in place, at any offset."""
        parts = (page_base, window, query_start_loc, seq_lens, block_tables, tile_seq, tile_q0)
        return jnp.concatenate([jnp.asarray(x, jnp.int32).reshape(-1) for x in parts])

    def _at(self, segment: int) -> int:
        sizes = (2, self.num_seqs + 1, self.num_seqs, self.num_seqs * self.table_width)
        return sum(sizes[:segment])

    @property
    def page_base(self):
        return self.ref[0]  # layer × blocks: the layer's first page in the flat cache

    @property
    def window(self):
        return self.ref[1]

    def query_start(self, seq):
        return self.ref[self._at(1) + seq]

    def seq_len(self, seq):
        return self.ref[self._at(2) + seq]

    def block(self, seq, column):
        return self.ref[self._at(3) + seq * self.table_width + column]

    def tile_seq(self, tile):
        return self.ref[self._at(4) + tile]

    def tile_q0(self, tile):
        return self.ref[self._at(4) + self.num_tiles + tile]


def _program(meta_ref, q_ref, pages_ref, o_ref, *, geo: _Geometry, plan: _Plan):
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    smem = functools.partial(plgpu.SMEM, dtype=geo.dtype, transforms=(tiling, swizzle))
    buffers = [smem((COMPUTE_GROUPS, ROWS_PER_GROUP, geo.head_dim)),  # Q
               smem((geo.slots, geo.block_kv, geo.head_dim)),  # K ring
               smem((geo.slots, geo.block_kv, geo.head_dim))]  # V ring
    if geo.staged_pv:
        buffers.append(smem((COMPUTE_GROUPS, ROWS_PER_GROUP, geo.block_kv)))  # P (see `_Geometry.staged_pv`)

    def scoped(*refs):
        smem_refs, barriers = refs[:len(buffers)], refs[len(buffers):]
        p_smem = smem_refs[3] if geo.staged_pv else None
        _worker(_Meta(meta_ref, geo.num_seqs, geo.table_width, plan.num_tiles), q_ref, pages_ref, o_ref,
                *smem_refs[:3], p_smem, *barriers, geo=geo, plan=plan)

    pl.run_scoped(
        scoped,
        *buffers,
        plgpu.Barrier(num_arrivals=geo.pages_per_step, num_barriers=geo.slots),  # K step landed
        plgpu.Barrier(num_arrivals=geo.pages_per_step, num_barriers=geo.slots),  # V step landed
        plgpu.Barrier(num_arrivals=COMPUTE_GROUPS, num_barriers=geo.slots),  # K slot free
        plgpu.Barrier(num_arrivals=COMPUTE_GROUPS, num_barriers=geo.slots),  # V slot free
        plgpu.Barrier(num_arrivals=COMPUTE_GROUPS),  # tensor-core turn
        collective_axes="wg",
    )


@dataclasses.dataclass(frozen=True)
class _Rows:
    """One compute warpgroup's query rows, tokens `token0 …+63` of the flat batch at positions `pos0 …+63`, and the
    KV steps they see: masked steps `[first, whole_from)`, whole steps `[whole_from, whole_to)`, masked steps
    `[whole_to, end)` (a window's lower edge, then the causal edge)."""

    token0: jax.Array
    pos0: jax.Array
    first: jax.Array
    whole_from: jax.Array
    whole_to: jax.Array
    end: jax.Array


def _rows(wg, q_start, q_len, seq_len, q0, window, block_kv) -> _Rows:
    row0 = jnp.minimum(q0 + wg * ROWS_PER_GROUP, q_len - ROWS_PER_GROUP)  # shifted back at the request's end
    pos0 = seq_len - q_len + row0
    last = pos0 + ROWS_PER_GROUP - 1
    windowed = window > 0
    first = jnp.where(windowed, lax.div(jnp.maximum(pos0 - window + 1, 0), block_kv), 0)
    end = lax.div(last, block_kv) + 1
    # whole for every row: at or past the last row's window start, and wholly at or before the first row
    last_window_start = jnp.where(windowed, jnp.maximum(last - window + 1, 0), 0)
    whole_from = jnp.clip(lax.div(last_window_start + block_kv - 1, block_kv), first, end)
    whole_to = jnp.clip(lax.div(pos0 + 1, block_kv), whole_from, end)
    return _Rows(q_start + row0, pos0, first, whole_from, whole_to, end)


def _worker(meta: _Meta, q_ref, pages_ref, o_ref, qo_smem, k_smem, v_smem, p_smem, k_ready, v_ready, k_free,
            v_free, turn, *, geo: _Geometry, plan: _Plan):
    """One warpgroup's part of its program's items. Every warpgroup walks the same items and counts the KV steps
    loaded so far (`base`), which fixes each step's ring slot: the producer may run into an item's steps while the
    compute groups finish the one before."""
    program, wg = lax.axis_index("program"), lax.axis_index("wg")

    def item(r):
        valid, head, tile = plan.item(program, r)
        seq = jnp.where(valid, meta.tile_seq(tile), geo.num_seqs)
        real = seq < geo.num_seqs  # spare tiles and the last round's missing items have no work
        seq = jnp.minimum(seq, geo.num_seqs - 1)
        q_start = meta.query_start(seq)
        q_len = meta.query_start(seq + 1) - q_start
        seq_len = meta.seq_len(seq)
        rows = functools.partial(_rows, q_start=q_start, q_len=q_len, seq_len=seq_len, q0=meta.tile_q0(tile),
                                 window=meta.window, block_kv=geo.block_kv)
        # the first group's rows are the tile's earliest, the last group's its latest
        steps = (rows(0).first, rows(COMPUTE_GROUPS - 1).end)
        return real, head, seq, seq_len, rows, steps

    def walk(work):
        """`work(head, seq, seq_len, rows, steps, base)` for each real item; returns the steps loaded in all."""
        def one(r, base):
            real, head, seq, seq_len, rows, steps = item(r)
            pl.when(real)(lambda: work(head, seq, seq_len, rows, steps, base))
            return base + jnp.where(real, steps[1] - steps[0], 0)

        return pl.loop(0, plan.rounds, init_carry=jnp.int32(0))(one)

    @pl.when(wg < COMPUTE_GROUPS)
    def _():
        plgpu.set_max_registers(232, action="increase")
        own_p = None if p_smem is None else p_smem.at[wg]
        walk(lambda head, seq, seq_len, rows, steps, base: _compute(
            q_ref, o_ref, qo_smem.at[wg], k_smem, v_smem, own_p, k_ready, v_ready, k_free, v_free, turn, head=head,
            wg=wg, window=meta.window, seq_len=seq_len, rows=rows(wg), steps=steps, base=base, geo=geo))

    @pl.when(wg == COMPUTE_GROUPS)
    def _():
        plgpu.set_max_registers(40, action="decrease")
        loaded = walk(lambda head, seq, seq_len, rows, steps, base: _produce(
            meta, pages_ref, k_smem, v_smem, k_ready, k_free, v_ready, v_free, seq=seq,
            kv_head=lax.div(head, geo.group), steps=steps, base=base, geo=geo))
        for i in range(geo.slots):  # the last round's releases: every phase of a barrier is seen before it goes
            @pl.when(loaded - geo.slots + i >= 0)
            def _():
                slot = lax.rem(loaded - geo.slots + i, geo.slots)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])


def _produce(meta: _Meta, pages_ref, k_smem, v_smem, k_ready, k_free, v_ready, v_free, *, seq, kv_head, steps, base,
             geo: _Geometry):
    """TMA-loads the pages of KV steps `[steps[0], steps[1])` into the ring, the program's `base + i`-th load into
    slot `(base + i) % slots`, each slot once both compute groups have released its previous load."""
    page_base = meta.page_base
    begin, end = steps

    @pl.loop(begin, end)
    def _(step):
        loaded = base + step - begin
        slot = lax.rem(loaded, geo.slots)

        @pl.when(loaded >= geo.slots)
        def _():
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])

        for j in range(geo.pages_per_step):
            column = jnp.minimum(step * geo.pages_per_step + j, geo.table_width - 1)
            page = page_base + jnp.maximum(meta.block(seq, column), 0)
            rows = pl.ds(j * geo.block_size, geo.block_size)
            plgpu.copy_gmem_to_smem(pages_ref.at[page, :, kv_head], k_smem.at[slot, rows], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(pages_ref.at[page, :, geo.kv_heads + kv_head], v_smem.at[slot, rows],
                                    v_ready.at[slot])


def _compute(q_ref, o_ref, qo_smem, k_smem, v_smem, p_smem, k_ready, v_ready, k_free, v_free, turn, *,
             head, wg, window, seq_len, rows: _Rows, steps, base, geo: _Geometry):
    """One compute group's rows: the online softmax over its steps, then its output rows stored. Step `s` sits in
    ring slot `(base + s - steps[0]) % slots` (`_worker`)."""
    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    def slot_of(step):
        return lax.rem(base + step - steps[0], geo.slots)

    # Q and O move through registers: a TMA box into swizzled shared memory must start on an 8-row tile, and a
    # request's rows start anywhere in the flat batch
    qo_smem[...] = plgpu.load(q_ref.at[pl.ds(rows.token0, ROWS_PER_GROUP), head], layout=plgpu.Layout.WGMMA,
                              optimized=False)
    plgpu.commit_smem()
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m = plgpu.layout_cast(jnp.full((ROWS_PER_GROUP,), M_INIT, jnp.float32), row_layout)
    l = plgpu.layout_cast(jnp.full((ROWS_PER_GROUP,), 0.0, jnp.float32), row_layout)
    acc = plgpu.layout_cast(jnp.zeros((ROWS_PER_GROUP, geo.head_dim), jnp.float32), plgpu.Layout.WGMMA)
    pl.when(wg == 1)(take_turn)  # the second group starts half a step behind the first

    def step_body(step, carry, masked: bool):
        acc, m, l = carry
        slot = slot_of(step)
        plgpu.barrier_wait(k_ready.at[slot])

        def scores(acc_ref):
            plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
            take_turn()
            return acc_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((ROWS_PER_GROUP, geo.block_kv), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        s = geo.logits(s)
        if masked:
            r = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
            c = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
            behind = rows.pos0 - step * geo.block_kv + r - c  # how far the row's position is past the column's
            s = jnp.where((behind >= 0) & ((window <= 0) | (behind < window)), s, -jnp.inf)
        m_new, alpha, p = geo.exponents(s, m)
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p = p.astype(geo.dtype)
        acc, l, m_new, p = lax.optimization_barrier((acc, l, m_new, p))
        plgpu.barrier_arrive(turn)  # softmax done: the other group may multiply
        plgpu.barrier_wait(v_ready.at[slot])
        if masked:
            zero_unowned_values(v_smem.at[slot], seq_len - step * geo.block_kv)
        plgpu.barrier_wait(turn)

        def values(acc_ref, p_operand):
            plgpu.wgmma(acc_ref, p_operand, v_smem.at[slot])

        if p_smem is None:  # P straight from registers, accumulated into the carried registers
            acc = pl.run_state(lambda acc_ref: values(acc_ref, p))(plgpu.ACC.init(acc))
        else:  # staged (see `_Geometry.staged_pv`)
            p_smem[...] = p
            plgpu.commit_smem()

            def fresh(acc_ref):
                values(acc_ref, p_smem)
                return acc_ref[...]

            acc = acc + pl.run_scoped(fresh, plgpu.ACC((ROWS_PER_GROUP, geo.head_dim), jnp.float32))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

    def idle_step(step, _):
        """Steps only the other group's rows see: follow the slot's phases, release it, and keep the turn-taking in
        step."""
        slot = slot_of(step)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        take_turn()
        take_turn()

    lax.fori_loop(steps[0], rows.first, idle_step, None)
    carry = lax.fori_loop(rows.first, rows.whole_from, functools.partial(step_body, masked=True), (acc, m, l))
    carry = lax.fori_loop(rows.whole_from, rows.whole_to, functools.partial(step_body, masked=False), carry)
    acc, m, l = lax.fori_loop(rows.whole_to, rows.end, functools.partial(step_body, masked=True), carry)
    lax.fori_loop(rows.end, steps[1], idle_step, None)
    pl.when(wg == 0)(take_turn)  # the first group's closing turn pairs the second's opening one

    out = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
    o_ref[pl.ds(rows.token0, ROWS_PER_GROUP), head] = out.astype(geo.dtype)


def zero_unowned_values(v_tile, owned):
    """Zeros the V rows from `owned` on, where the request's last step runs past its length: those slots hold
    whatever an earlier owner of the page left there, NaN included, and a masked score's zero weight times NaN is
    NaN. Both groups may zero the same rows of a shared slot; each does before its own P V, and zeros over zeros
    change nothing."""
    @pl.when(owned < v_tile.shape[0])
    def _():
        v = plgpu.load(v_tile, layout=plgpu.Layout.WGMMA)
        row = plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=plgpu.Layout.WGMMA)
        v_tile[...] = jnp.where(row < owned, v, jnp.zeros_like(v))
        plgpu.commit_smem()
