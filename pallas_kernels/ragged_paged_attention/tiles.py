"""Device code shared by the ragged paged attention kernels (`kernel.py`): static geometry, the visible range and
split rule, K/V tile loads through the block table (a float8 cache as uint16 byte pairs), the online-softmax loop and
the row loads and stores. Every block has a power-of-two element count and every ref access indexes all axes with
arrays or scalars (the Triton lowering's rules, JAX-PALLAS.md §1.2)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltr

from pallas_kernels.addressing import next_pow2
from pallas_kernels.kv_quant import FP8_DTYPE
from pallas_kernels.ragged_paged_attention.tuning import KernelConfig, SplitConfig

LOG2E = math.log2(math.e)
# Finite start for the running max: exp2(m_old - m_new) stays finite while a row has seen no visible key yet, and
# masked scores are -inf, so they contribute exp2(-inf) = 0 without an extra select.
M_INIT = -1e30


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static shapes of one call, derived once from the operands."""

    num_tokens: int
    num_seqs: int
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    quantized: bool  # float8 cache: per-(layer, KV head) scales are read and applied

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def group_pad(self) -> int:
        return 1 << max(self.group - 1, 0).bit_length()

    @property
    def parts(self) -> int:
        """Column parts of every head_dim-wide tile: 2 (even, odd columns) for a float8 cache read as byte pairs."""
        return 2 if self.quantized else 1


def tokens_per_tile(geo: Geometry, cfg: KernelConfig) -> int:
    return cfg.block_m // geo.group_pad


def cdiv(a, b):
    return (a + b - 1) // b


def latest_first(tiles: jax.Array, num_tiles: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A static-length tile table (host-side XLA, for either prefill kernel) from each request's tile count: per
    slot, its request (`len(tiles)` for the spare slots after the last real tile), the tile's index counted back
    from its request's last tile (the heaviest runs first), and the slot's index among the spare ones."""
    num_seqs = tiles.shape[0]
    cum = jnp.cumsum(tiles)
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.searchsorted(cum, i, side="right").astype(jnp.int32)
    sc = jnp.minimum(seq, num_seqs - 1)
    from_last = tiles[sc] - 1 - (i - (cum[sc] - tiles[sc]))
    return seq, from_last, i - cum[-1]


# ---------------------------------------------------------------------------------------------------------------
# Shared device code: visible range, split rule, the online-softmax loop.


def visible_range(first_pos, last_pos, window, block_n: int):
    """KV positions `[lo, hi)` some row of a query tile can see (`lo` aligned down to `block_n`); `first_pos` and
    `last_pos` are the positions of the tile's first and last query token. Works on scalars and arrays alike."""
    lo = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)
    return (lo // block_n) * block_n, last_pos + 1


def num_segments(lo, hi, segment: int):
    """How many of the absolute segments `[j·segment, (j+1)·segment)` the range `[lo, hi)` crosses."""
    return (hi - 1) // segment - lo // segment + 1


def segment_range(lo, hi, j, segment: int):
    """The part of `[lo, hi)` in its `j`-th segment (absolute segment `lo // segment + j`)."""
    start = (lo // segment + j) * segment
    return jnp.maximum(lo, start), jnp.minimum(hi, start + segment)


def num_splits(lo, hi, split: SplitConfig):
    """How many chunks a decode request's context is cut into: a function of its own visible range only."""
    if split.absolute:
        return num_segments(lo, hi, split.split_tokens)
    return jnp.clip(cdiv(hi - lo, split.split_tokens), 1, split.max_splits)


def num_partials(lo, hi, split: SplitConfig):
    """How many partial results a decode request's context leaves for the merge: one a segment in the absolute
    mode (a split may walk several), else one a split."""
    return num_segments(lo, hi, split.fold) if split.absolute else num_splits(lo, hi, split)


def split_range(lo, hi, s, split: SplitConfig, block_n: int):
    """Chunk `s` of `[lo, hi)`: chunks are multiples of `block_n`, so no KV tile straddles two of them."""
    if split.absolute:  # chunk lo // split_tokens + s of the positions from 0
        return segment_range(lo, hi, s, split.split_tokens)
    nsplit = num_splits(lo, hi, split)
    chunk = cdiv(cdiv(hi - lo, nsplit), block_n) * block_n
    my_lo = lo + s * chunk
    return my_lo, jnp.minimum(hi, my_lo + chunk)


def empty_state(part_shapes: tuple[tuple[int, int], ...]):
    """(sums, running max, weight) before anything is added, for rows of column parts of `part_shapes`: the online
    softmax's and the merge's start alike (the merge and the prefill kernel's fold must start from the same bits)."""
    rows = part_shapes[0][0]
    return (tuple(jnp.zeros(shape, jnp.float32) for shape in part_shapes), jnp.full((rows,), M_INIT, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def merge_partial(carry, out, lse):
    """One split's normalised rows `out` (column parts) and base-2 LSE folded into the running (sum, max, weight):
    the merge kernel's arithmetic, which the batch-invariant prefill kernel repeats for its rows' segments."""
    acc, m, den = carry
    m_new = jnp.maximum(m, lse)
    alpha, w = jnp.exp2(m - m_new), jnp.exp2(lse - m_new)
    return tuple(a * alpha[:, None] + o * w[:, None] for a, o in zip(acc, out)), m_new, den * alpha + w


def merged_rows(acc, den):
    """The merged rows: the folded sum over its weight (rows that saw nothing: 0)."""
    return tuple(a / jnp.where(den > 0, den, 1.0)[:, None] for a in acc)


@dataclasses.dataclass(frozen=True)
class KVSource:
    """Where one program's K/V come from: its request's block-table row in one layer, one KV head."""

    kv_ref: object
    bt_ref: object
    seq: jax.Array
    layer: jax.Array
    head: jax.Array
    kv_hi: jax.Array  # positions >= kv_hi are never loaded (the block table may end there)
    block_size: int
    # `KernelConfig.prefetch_pages`: a KV step's page ids are read during the step before (`attend` carries them),
    # so a step waits on one load's latency, its K/V, instead of two in a chain (page ids, then K/V)
    prefetch: bool = False

    def pages(self, start, block_n: int):
        """The page of each position `start + arange(block_n)` (0 past `kv_hi`, where nothing is read)."""
        pos = start + jnp.arange(block_n, dtype=jnp.int32)
        page_idx = pos >> (self.block_size.bit_length() - 1)
        return pltr.load(self.bt_ref.at[self.seq, page_idx], mask=pos < self.kv_hi, other=0)

    def load(self, start, block_n: int, masked: bool, dtype, pages=None):
        """K and V for positions `start + arange(block_n)`, each a tuple of column parts `[block_n, head_dim //
        parts]`: each row is found through the block table (page = position // block_size; or `pages`, read
        ahead by `pages()`) and read at `[layer, page, offset, 0|1, head, :]`. A float8 cache comes as uint16 byte
        pairs and is unpacked here."""
        pos = start + jnp.arange(block_n, dtype=jnp.int32)
        shift = self.block_size.bit_length() - 1
        page_idx, offset = pos >> shift, (pos & (self.block_size - 1))[:, None]
        cols = column_index(self.kv_ref.shape[-1])
        if masked:
            ok = pos < self.kv_hi
            page = (self.pages(start, block_n) if pages is None else pages)[:, None]
            ok2 = jnp.broadcast_to(ok[:, None], (block_n, cols.shape[1]))
            k = pltr.load(self.kv_ref.at[self.layer, page, offset, 0, self.head, cols], mask=ok2, other=0)
            v = pltr.load(self.kv_ref.at[self.layer, page, offset, 1, self.head, cols], mask=ok2, other=0)
        else:
            page = (self.bt_ref[self.seq, page_idx] if pages is None else pages)[:, None]
            k = self.kv_ref[self.layer, page, offset, 0, self.head, cols]
            v = self.kv_ref[self.layer, page, offset, 1, self.head, cols]
        if self.kv_ref.dtype == jnp.uint16:
            return pos, unpack_fp8_pairs(k, dtype), unpack_fp8_pairs(v, dtype)
        return pos, (k.astype(dtype),), (v.astype(dtype),)


def unpack_fp8_pairs(x16, dtype):
    """uint16 byte pairs → (even columns, odd columns) as `dtype`. Why pairs: the P·V product reads V along its
    rows, so the tile is transposed on its way to the tensor cores; Triton transposes 16-bit tiles with `ldmatrix`
    but 8-bit ones byte by byte through shared memory (a third slower on the H200). Unpacked in registers, both
    halves are ordinary 16-bit operands (exact: every e4m3 value is a bf16 value). The hardware conversion measured
    faster than placing the e4m3 bits into a bf16 by integer operations (240 vs 258 µs, batch 8 × 32k)."""
    lo = lax.bitcast_convert_type((x16 & 0xFF).astype(jnp.uint8), FP8_DTYPE)
    hi = lax.bitcast_convert_type((x16 >> 8).astype(jnp.uint8), FP8_DTYPE)
    return lo.astype(dtype), hi.astype(dtype)


QUERY_SHIFT = 4  # float16 operands: the query enters scaled by 2^-4 (|q| up to 1e6 fits), the scores leave × 2^4


@dataclasses.dataclass(frozen=True)
class Scores:
    """Static score transform: scale, optional soft cap, conversion to base 2 (the loop uses exp2). `sums_by_mma`
    (the batch-invariant mode): the softmax's row sums are taken by the tensor cores, as the output's are, so a row
    adds up in one order whatever the tile's shape and warps (a `jnp.sum` follows the register layout).
    `float16_operands` (a float8 cache, `Tuning.fp8_operands`): the tensor cores multiply float16 (e4m3 converts to
    it in one instruction a pair, where bfloat16 takes more); the query is scaled by an exact power of two into
    float16's range and the scores scaled back."""

    scale: float
    soft_cap: float | None
    precision: lax.Precision | None
    sums_by_mma: bool = False
    float16_operands: bool = False

    def operands(self, q):
        """The query's column parts as the tensor cores take them."""
        if not self.float16_operands:
            return q
        return tuple((qp.astype(jnp.float32) * 2.0 ** -QUERY_SHIFT).astype(jnp.float16) for qp in q)

    def __call__(self, q, k, k_scale=1.0):
        """`q` (from `operands`), `k`: tuples of matching column parts (their dot products add up to q·kᵀ).
        `k_scale`: the float8 cache's dequantization scale of K (a traced scalar), or the Python 1.0."""
        s = sum(pltr.dot(qp, kp, trans_b=True, precision=self.precision) for qp, kp in zip(q, k))
        scale = self.scale * 2.0 ** QUERY_SHIFT if self.float16_operands else self.scale
        if self.soft_cap:
            return jnp.tanh(s * (k_scale * (scale / self.soft_cap))) * (self.soft_cap * LOG2E)
        return s * (k_scale * (scale * LOG2E))


def attend(q, q_pos, src: KVSource, lo, hi, first_pos, last_pos, window, *, block_n: int, scores: Scores,
            k_scale=1.0):
    """Online softmax of the query tile `q` (column parts of `[block_m, d]`, rows at positions `q_pos`) over KV
    positions `[lo, hi)`.

    Returns (acc, m, l): unnormalised output (column parts like `q`), running max and sum, base 2. The tiles every
    row sees in full (between the window edge and the first row's position) skip the mask; the edge tiles on either
    side apply it.
    """
    t0, t1 = lo // block_n, cdiv(hi, block_n)
    full_lo = jnp.where(window > 0, last_pos - window + 1, 0)
    u0 = jnp.clip(cdiv(full_lo, block_n), t0, t1)
    u1 = jnp.clip((first_pos + 1) // block_n, u0, t1)

    def step(masked: bool):
        def body(j, carry):
            acc, m, l, *pages = carry
            pos, k, v = src.load(j * block_n, block_n, masked, q[0].dtype, *pages)
            if pages:
                pages = [src.pages((j + 1) * block_n, block_n)]  # read while this step's K/V are on their way
            s = scores(q, k, k_scale)
            if masked:
                visible = pos[None, :] <= q_pos[:, None]
                visible &= (window <= 0) | (pos[None, :] > q_pos[:, None] - window)
                s = jnp.where(visible, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new[:, None])
            if scores.sums_by_mma:
                p = p.astype(v[0].dtype)
                l = l * alpha + row_sums_by_mma(p, scores.precision)
            else:
                l = l * alpha + jnp.sum(p, axis=1)
                p = p.astype(v[0].dtype)
            acc = tuple(a * alpha[:, None] + pltr.dot(p, vp, precision=scores.precision) for a, vp in zip(acc, v))
            return acc, m_new, l, *pages

        return body

    first_pages = (src.pages(t0 * block_n, block_n),) if src.prefetch else ()
    carry = lax.fori_loop(t0, u0, step(True), (*empty_state(tuple(qp.shape for qp in q)), *first_pages))
    carry = lax.fori_loop(u0, u1, step(False), carry)
    return lax.fori_loop(u1, t1, step(True), carry)[:3]


MMA_N = 16  # the narrowest product the tensor cores (and Triton's dot) take


def row_sums_by_mma(p, precision):
    """Each row's sum of `p` as a product with a ones matrix: the tensor cores add the row in 16-wide slices in a
    fixed chain, whatever the tile's rows or warps. All MMA_N columns hold the same sum; their max is exact."""
    ones = jnp.ones((p.shape[1], MMA_N), p.dtype)
    return jnp.max(pltr.dot(p, ones, precision=precision), axis=1)


def attend_in_segments(q, q_pos, src: KVSource, lo, hi, first_pos, last_pos, window, *, block_n: int, scores: Scores,
                       segment: int, k_scale=1.0, v_scale=1.0):
    """`attend` over `[lo, hi)` cut at the multiples of `segment`, each segment's rows normalised and folded by
    their LSE in order (`merge_partial`): a row gets the bits a decode's absolute splits and their merge give it,
    whatever its tile (a segment a row cannot see folds in as nothing). Returns the merged rows."""
    def body(j, carry):
        return merge_partial(carry, *segment_rows(q, q_pos, src, lo, hi, j, first_pos, last_pos, window,
                                                  block_n=block_n, scores=scores, segment=segment, k_scale=k_scale,
                                                  v_scale=v_scale))

    acc, _, den = lax.fori_loop(0, num_segments(lo, hi, segment), body, empty_state(tuple(qp.shape for qp in q)))
    return merged_rows(acc, den)


def segment_rows(q, q_pos, src: KVSource, lo, hi, j, first_pos, last_pos, window, *, block_n: int, scores: Scores,
                 segment: int, k_scale=1.0, v_scale=1.0):
    """The rows over the `j`-th segment of `[lo, hi)`, normalised, and their base-2 LSE (`finish`): one partial
    result of `attend_in_segments`, which a program may also store for a merge to fold."""
    seg_lo, seg_hi = segment_range(lo, hi, j, segment)
    acc, m, l = attend(q, q_pos, src, seg_lo, seg_hi, first_pos, last_pos, window, block_n=block_n, scores=scores,
                       k_scale=k_scale)
    return finish(acc, m, l, v_scale)


def finish(acc, m, l, v_scale=1.0):
    """Normalised output (times V's dequantization scale) and base-2 log-sum-exp; rows that saw nothing give 0
    and -inf."""
    seen = l > 0
    inv = 1.0 / jnp.where(seen, l, 1.0)
    if not isinstance(v_scale, float):
        inv = inv * v_scale
    out = tuple(a * inv[:, None] for a in acc)
    return out, jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)


def head_scales(scales_ref, layer, head, geo: Geometry):
    """(K scale, V scale) of one layer and KV head from the flattened `[layers * 2 * kv_heads]` table; Python 1.0s
    for an unquantized cache (the table is then a placeholder, never read)."""
    if not geo.quantized:
        return 1.0, 1.0
    base = layer * (2 * geo.kv_heads) + head
    return scales_ref[base], scales_ref[base + geo.kv_heads]


def query_rows(block_m: int, group: int, group_pad: int):
    """Row r of a query tile is token r // group_pad, query head r % group_pad of the KV head (padded heads masked)."""
    rows = jnp.arange(block_m, dtype=jnp.int32)
    shift = group_pad.bit_length() - 1
    return rows >> shift, rows & (group_pad - 1)


def column_index(head_dim: int, parts: int = 1, part: int = 0):
    """Column index `[1, head_dim // parts]` of column part `part` (columns `part`, `part + parts`, ...). Every ref
    access indexes all axes with arrays or scalars (no slices): the one form that both the Triton lowering and
    interpret mode accept for gathers."""
    return jnp.arange(head_dim // parts, dtype=jnp.int32)[None, :] * parts + part


def load_q(q_ref, tok, head, valid, parts: int):
    d = q_ref.shape[-1]
    mask = jnp.broadcast_to(valid[:, None], (tok.shape[0], d // parts))
    return tuple(pltr.load(q_ref.at[tok[:, None], head[:, None], column_index(d, parts, i)], mask=mask, other=0)
                 for i in range(parts))


def store_rows(o_ref, tok, head, valid, value):
    """Masked row store of column parts; masked rows point past the end (interpret mode writes them as no-ops only
    there)."""
    tok = jnp.where(valid, tok, o_ref.shape[0])
    mask = jnp.broadcast_to(valid[:, None], value[0].shape)
    for i, part in enumerate(value):
        cols = column_index(o_ref.shape[-1], len(value), i)
        pltr.store(o_ref.at[tok[:, None], head[:, None], cols], part.astype(o_ref.dtype), mask=mask)


def zero_padding_rows(o_ref, qsl_ref, b, h, geo: Geometry, tile_tokens: int):
    """Program (request b, KV head h) of a decode-only step writes zeros into its share of the padding tokens' rows
    (those after the last request's): `cdiv(num_tokens, num_seqs)` (to a power of two) per request slot, KV head h's
    query heads, in tiles of `tile_tokens` tokens. The programs together cover every padding row, so the step's
    output needs no zero-filled buffer copied in to start from."""
    per_seq = next_pow2(cdiv(geo.num_tokens, geo.num_seqs))
    chunk = min(per_seq, tile_tokens)
    t, g = query_rows(chunk * geo.group_pad, geo.group, geo.group_pad)
    zeros = jnp.zeros((chunk * geo.group_pad, geo.head_dim), o_ref.dtype)
    for first in range(0, per_seq, chunk):
        tok = qsl_ref[geo.num_seqs] + b * per_seq + first + t
        valid = (tok < geo.num_tokens) & (g < geo.group)
        store_rows(o_ref, tok, jnp.where(valid, h * geo.group + g, 0), valid, (zeros,))
