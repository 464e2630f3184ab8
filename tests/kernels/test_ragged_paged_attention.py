"""The ragged paged attention kernel (interpret mode) against its pure-jnp reference on ragged random batches.

Shapes are fixed buckets per configuration so hypothesis examples reuse one compile; sliding windows are traced, so
they vary freely. Poisoning: interpret mode starts every kernel output as NaN (checked below), the cache holds NaN in
every slot no request owns, and padding tokens' queries are NaN — an unwritten row or a stray read shows up as NaN.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl

from pallas_kernels.ragged_paged_attention import UnsupportedShapeError, kernel, reference
from pallas_kernels.ragged_paged_attention.tuning import KernelConfig, SplitConfig, Tuning, default_tuning
from tests.kernels.batches import Batch, Bucket, build

LAYER = 1

# Tiles of 16 positions, splits of one tile (at most 4): with the tiny test contexts, the default 128-wide tiles
# would rarely cross a tile or split edge.
SMALL_SPLITS = Tuning(
    decode=KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=2),
    prefill=KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=2),
    split=SplitConfig(split_tokens=16, max_splits=4),
)

# The bucket the fixed-shape tests share (one compile): GQA 4, float32, d=64, pages of 16.
FIXED = Bucket(q_heads=8, kv_heads=2)

# (bucket, soft_cap, tuning): GQA ratios 1, 4, 8 and a non-power-of-two 3; f32 and bf16; pages of 16..64; d 64 and
# 128; default tiles (None) and small tiles.
CONFIGS = {
    "g4-f32-bs16": (FIXED, None, None),
    "g1-bf16-bs32-d128": (Bucket(q_heads=2, kv_heads=2, head_dim=128, block_size=32, width=5, dtype=jnp.bfloat16),
                          None, None),
    "g8-f32-bs16-cap-small-tiles": (Bucket(q_heads=8, kv_heads=1), 5.0, SMALL_SPLITS),
    "g3-bf16-bs64": (Bucket(q_heads=6, kv_heads=2, block_size=64, width=3, dtype=jnp.bfloat16), None, None),
}


def run_both(bucket: Bucket, batch: Batch, *, window: int, soft_cap: float | None, max_query_len: int,
             tuning: Tuning | None = None):
    scale = bucket.head_dim ** -0.5
    args = (batch.query_start_loc, batch.seq_lens, batch.block_tables)
    window = jnp.int32(window)  # traced, typed as the engine passes it: every test of a bucket shares one compile
    if tuning is None:
        out = kernel.ragged_paged_attention(
            batch.q, batch.kv_kernel, LAYER, *args, scale=scale, sliding_window=window, soft_cap=soft_cap,
            max_query_len=max_query_len, interpret=True)
    else:
        out = _with_tuning(batch.q, batch.kv_kernel, LAYER, *args, window, scale=scale, soft_cap=soft_cap,
                           max_query_len=max_query_len, tuning=tuning)
    ref = reference.ragged_paged_attention(
        batch.q, batch.kv_reference, LAYER, *args, scale=scale, sliding_window=window, soft_cap=soft_cap,
        max_query_len=max_query_len)
    return np.asarray(out, np.float32), np.asarray(ref, np.float32)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "max_query_len", "tuning"))
def _with_tuning(q, kv, layer, qsl, lens, bt, window, *, scale, soft_cap, max_query_len, tuning):
    return kernel.ragged_paged_attention_impl(
        q, kv, layer, qsl, lens, bt, scale=scale, sliding_window=window, soft_cap=soft_cap,
        max_query_len=max_query_len, interpret=True, tuning=tuning)


def assert_close(out: np.ndarray, ref: np.ndarray, batch: Batch, dtype) -> None:
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    n = batch.num_real_tokens
    assert np.isfinite(out).all(), "NaN/inf in the kernel output (unwritten row or poisoned read)"
    np.testing.assert_allclose(out[:n], ref[:n], atol=tol, rtol=tol)
    assert (out[n:] == 0).all(), "padding tokens must come back as zeros"


@st.composite
def ragged_requests(draw, bucket: Bucket):
    """(q_lens, seq_lens): lengths 1, block-size edges and random ones; contexts from none to the table width."""
    bs = bucket.block_size
    n = draw(st.integers(1, bucket.num_seqs))
    budget = bucket.num_tokens
    q_lens, seq_lens = [], []
    for _ in range(n):
        if budget == 0:
            break
        q = draw(st.sampled_from([1, 1, 2, bs - 1, bs, bs + 1, 33]) | st.integers(1, budget))
        q = min(q, budget)
        budget -= q
        extra = draw(st.sampled_from([0, bs - q % bs, bucket.max_context - q]) | st.integers(0, bucket.max_context - q))
        q_lens.append(q)
        seq_lens.append(q + max(0, min(extra, bucket.max_context - q)))
    return q_lens, seq_lens


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_random_ragged_batches_match_reference(name):
    bucket, soft_cap, tuning = CONFIGS[name]

    @settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(ragged_requests(bucket), st.sampled_from([0, 0, 1, 5, bucket.block_size, 40]), st.integers(0, 2**16))
    def check(requests, window, seed):
        q_lens, seq_lens = requests
        batch = build(bucket, q_lens, seq_lens, seed=seed, layer=LAYER)
        out, ref = run_both(bucket, batch, window=window, soft_cap=soft_cap, max_query_len=bucket.num_tokens,
                            tuning=tuning)
        assert_close(out, ref, batch, bucket.dtype)

    check()


@pytest.mark.parametrize(
    "q_lens,seq_lens,window",
    [
        ([1] * 6, [1, 16, 17, 100, 160, 33], 0),  # decodes only, page edges
        ([1, 1, 1], [160, 2, 64], 7),  # decodes with a window, padding requests
        ([64], [160], 0),  # one chunk filling the token bucket, over a cached prefix
        ([60, 1, 1, 1, 1], [60, 90, 5, 31, 32], 20),  # mixed step, window
        ([4, 4, 16, 17], [4, 40, 16, 160], 0),  # speculative-sized queries at the decode/prefill boundary
    ],
)
def test_fixed_padded_shapes(q_lens, seq_lens, window):
    batch = build(FIXED, q_lens, seq_lens, seed=len(q_lens))
    out, ref = run_both(FIXED, batch, window=window, soft_cap=None, max_query_len=FIXED.num_tokens)
    assert_close(out, ref, batch, FIXED.dtype)


def test_decode_only_bucket_skips_prefill_launch():
    """max_query_len=1 (a decode bucket): only the split-K kernel runs; padding rows still come back as zeros."""
    batch = build(FIXED, [1] * 5, [3, 17, 160, 48, 1], seed=3)
    out, ref = run_both(FIXED, batch, window=0, soft_cap=None, max_query_len=1)
    assert_close(out, ref, batch, FIXED.dtype)


def test_the_batch_invariant_tuning_follows_the_step():
    """The batch-invariant mode's decode runs one split over prefill-wide KV tiles; a short step's prefill tiles
    are `short_prefill`'s (the decode kernel's where it is unset); a long step keeps the prefill table's. The
    default is untouched."""
    base = default_tuning(128, 4)
    long, short = base.batch_invariant(1024, 4, 2048), base.batch_invariant(64, 4, 2048)
    for tuning in (long, short):
        assert tuning.split.max_splits == 1 and tuning.decode.block_n == base.prefill.block_n
    assert long.prefill == base.prefill
    assert (short.prefill.block_m, short.prefill.block_n, short.prefill.num_warps) == (
        base.short_prefill.block_m, base.prefill.block_n, base.short_prefill.num_warps)
    unset = dataclasses.replace(base, short_prefill=None).batch_invariant(64, 4, 2048)
    assert (unset.prefill.block_m, unset.prefill.block_n, unset.prefill.num_warps) == (
        base.decode.block_m, base.prefill.block_n, base.decode.num_warps)
    assert default_tuning(128, 4) == base


@pytest.mark.parametrize("max_query_len,q_lens", [(1, [1] * 5), (64, [1, 20, 2, 30])])
def test_single_path_matches_reference_with_windows(max_query_len, q_lens):
    """The batch-invariant path (one-split decodes, small prefill tiles for these short steps) against the dense
    reference over contexts crossing its KV tiles, decode-only and mixed, with and without a window."""
    batch = build(FIXED, q_lens, [150, 70, 160, 31, 129][:len(q_lens)], seed=11)
    args = (batch.query_start_loc, batch.seq_lens, batch.block_tables)
    for window in (0, 40):
        out = np.asarray(kernel.ragged_paged_attention(
            batch.q, batch.kv_kernel, LAYER, *args, scale=FIXED.head_dim ** -0.5, sliding_window=jnp.int32(window),
            max_query_len=max_query_len, interpret=True, single_path=True), np.float32)
        ref = np.asarray(reference.ragged_paged_attention(
            batch.q, batch.kv_reference, LAYER, *args, scale=FIXED.head_dim ** -0.5, sliding_window=jnp.int32(window),
            max_query_len=max_query_len), np.float32)
        assert_close(out, ref, batch, FIXED.dtype)


SMALL_BUCKET, SMALL_CAP, _ = CONFIGS["g8-f32-bs16-cap-small-tiles"]


def test_many_splits_and_small_tiles_match_reference():
    """Splits of one 16-token tile each (and clamped at 4), prefill tiles of 2 tokens: merge and tile edges."""
    batch = build(SMALL_BUCKET, [1, 1, 3, 9, 30, 1], [160, 40, 20, 100, 30, 17], seed=5)
    for window in (0, 23):
        out, ref = run_both(SMALL_BUCKET, batch, window=window, soft_cap=SMALL_CAP, max_query_len=64,
                            tuning=SMALL_SPLITS)
        assert_close(out, ref, batch, SMALL_BUCKET.dtype)


@pytest.mark.parametrize("bucket,soft_cap,tuning", [(FIXED, None, None), (SMALL_BUCKET, SMALL_CAP, SMALL_SPLITS)])
def test_a_requests_output_does_not_depend_on_the_batch(bucket, soft_cap, tuning):
    """The engine's invariance promise: split counts and tile order depend on the request alone, so its rows are
    bitwise identical alone and beside others (same seed: same pages, cache values and queries for the first two)."""
    alone = build(bucket, [1, 20], [150, 70], seed=9)
    crowd = build(bucket, [1, 20, 1, 30], [150, 70, 160, 31], seed=9)
    np.testing.assert_array_equal(alone.block_tables[:2], crowd.block_tables[:2])
    out_alone, _ = run_both(bucket, alone, window=0, soft_cap=soft_cap, max_query_len=64, tuning=tuning)
    out_crowd, _ = run_both(bucket, crowd, window=0, soft_cap=soft_cap, max_query_len=64, tuning=tuning)
    np.testing.assert_array_equal(out_alone[:21], out_crowd[:21])


def test_reference_agrees_with_the_engine_oracle():
    """This package's reference (which may not import jengine) against jengine's own oracle."""
    from jengine.attention import reference as engine_reference
    from jengine.attention.metadata import AttentionMetadata

    batch = build(FIXED, [1, 17, 5], [40, 17, 100], seed=11)
    zeros = jnp.zeros(FIXED.num_tokens, jnp.int32)
    md = AttentionMetadata(zeros, zeros, batch.query_start_loc, batch.seq_lens, batch.block_tables, 64)
    kw = dict(scale=FIXED.head_dim ** -0.5, sliding_window=9, soft_cap=None)  # the static args other tests compile
    ours = reference.ragged_paged_attention(batch.q, batch.kv_reference, LAYER, batch.query_start_loc, batch.seq_lens,
                                            batch.block_tables, max_query_len=FIXED.num_tokens, **kw)
    theirs = engine_reference.paged_attention(jnp.nan_to_num(batch.q), batch.kv_reference, LAYER, md, **kw)
    n = batch.num_real_tokens
    np.testing.assert_allclose(np.asarray(ours[:n]), np.asarray(theirs[:n]), atol=1e-6)


def test_interpret_mode_starts_outputs_as_nan():
    """The poisoning the tests above rely on: an output the kernel never writes stays NaN."""
    out = pl.pallas_call(lambda o_ref: None, out_shape=jax.ShapeDtypeStruct((8, 8), jnp.float32), interpret=True)()
    assert np.isnan(np.asarray(out)).all()


@pytest.mark.parametrize("head_dim,block_size", [(96, 16), (256, 16), (64, 8), (128, 24)])
def test_unsupported_shapes_raise_a_clear_error(head_dim, block_size):
    q = jnp.zeros((4, 4, head_dim))
    kv = jnp.zeros((1, 4, block_size, 2, 2, head_dim))
    i = jnp.zeros(2, jnp.int32)
    with pytest.raises(UnsupportedShapeError, match="head_dim|block_size"):
        kernel.ragged_paged_attention(q, kv, 0, jnp.zeros(2, jnp.int32), i[:1], jnp.zeros((1, 2), jnp.int32),
                                      scale=1.0, max_query_len=1, interpret=True)


def _single_path(bucket: Bucket, batch: Batch, max_query_len: int) -> np.ndarray:
    return np.asarray(kernel.ragged_paged_attention(
        batch.q, batch.kv_kernel, LAYER, batch.query_start_loc, batch.seq_lens, batch.block_tables,
        scale=bucket.head_dim ** -0.5, max_query_len=max_query_len, interpret=True, single_path=True), np.float32)


def test_single_path_matches_reference_and_a_short_last_chunk_equals_the_whole_prompt():
    """The batch-invariant mode (`single_path`): a prompt's last rows are bitwise the same computed in one piece
    (the prefill kernel) or as a 2-token last chunk (the decode kernel, in one split over prefill-wide KV tiles),
    and a mixed batch still matches the dense reference."""
    mixed = build(FIXED, [1, 20, 2, 30], [150, 70, 40, 31], seed=5)
    out = _single_path(FIXED, mixed, 64)
    _, ref = run_both(FIXED, mixed, window=0, soft_cap=None, max_query_len=64)
    assert_close(out, ref, mixed, FIXED.dtype)
    whole = build(FIXED, [40], [40], seed=6)
    q = np.full(np.shape(whole.q), np.nan, np.float32)
    q[:2] = np.asarray(whole.q)[38:40]
    chunk = dataclasses.replace(whole, q=jnp.asarray(q), num_real_tokens=2, query_start_loc=jnp.asarray(
        np.concatenate([[0], np.full(FIXED.num_seqs, 2)]).astype(np.int32)))
    np.testing.assert_array_equal(_single_path(FIXED, chunk, 64)[:2], _single_path(FIXED, whole, 64)[38:40])


def _last_rows_as_own_chunk(batch: Batch, count: int) -> Batch:
    """The batch's one request with only its last `count` new tokens (the same context and cache)."""
    n = batch.num_real_tokens
    q = np.zeros(np.shape(batch.q), np.float32)
    q[:count] = np.asarray(batch.q, np.float32)[n - count:n]
    starts = np.concatenate([[0], np.full(batch.seq_lens.shape[0], count)]).astype(np.int32)
    return dataclasses.replace(batch, q=jnp.asarray(q, batch.q.dtype), num_real_tokens=count,
                               query_start_loc=jnp.asarray(starts))


@pytest.mark.parametrize("window", [0, 50])
def test_single_path_decode_kernel_rows_equal_the_prefill_kernel_rows_across_kv_tiles(window):
    """Production tiles (KV tiles of 128, bf16, d=128) over a 180-token context: the last 1 or 3 tokens of a
    40-token chunk are bitwise the rows the decode kernel gives them as a decode or a short chunk, with and without
    a sliding window, whether the chunk's step takes the prefill kernel's 128-row tiles (a large bucket) or the
    small ones of a short step (`Tuning.batch_invariant`)."""
    bucket = Bucket(q_heads=8, kv_heads=2, head_dim=128, width=12, dtype=jnp.bfloat16)
    chunk = build(bucket, [40], [180], seed=7)

    def run(batch: Batch, max_query_len: int) -> np.ndarray:
        return np.asarray(kernel.ragged_paged_attention(
            batch.q, batch.kv_kernel, LAYER, batch.query_start_loc, batch.seq_lens, batch.block_tables,
            scale=bucket.head_dim ** -0.5, sliding_window=jnp.int32(window), max_query_len=max_query_len,
            interpret=True, single_path=True), np.float32)

    whole = run(chunk, 256)
    np.testing.assert_array_equal(run(chunk, 64), whole)
    for count in (1, 3):
        np.testing.assert_array_equal(run(_last_rows_as_own_chunk(chunk, count), 4)[:count], whole[40 - count:40])


def _widened(batch: Batch, width: int) -> Batch:
    """The same batch with its block tables padded to `width` columns (never read: past every context)."""
    tables = np.zeros((batch.block_tables.shape[0], width), np.int32)
    tables[:, :batch.block_tables.shape[1]] = batch.block_tables
    return dataclasses.replace(batch, block_tables=jnp.asarray(tables))


@pytest.mark.parametrize("q_lens,seq_lens,max_query_len", [
    ([1] * 5, [3, 17, 160, 48, 1], 1),  # decodes only: the output starts as zeros
    ([1, 20, 1, 30], [150, 70, 160, 31], 64),  # beside prefills: the decode rows go into the prefill's output
])
def test_one_split_contexts_skip_the_merge_with_the_same_bits(q_lens, seq_lens, max_query_len):
    """A block table of at most `split_tokens` positions (FIXED's 160 against 512) means one split for every
    request: the decode kernel writes the rows itself and no merge runs. The rows are the reference's, and bitwise
    those of the same batch through split + merge (its table widened past one split's reach), so a request's
    output does not depend on the bucket its step's table landed in."""
    batch = build(FIXED, q_lens, seq_lens, seed=11)
    wide = _widened(batch, 40)  # 640 positions > 512: the merge path
    direct, ref = run_both(FIXED, batch, window=0, soft_cap=None, max_query_len=max_query_len)
    merged, _ = run_both(FIXED, wide, window=0, soft_cap=None, max_query_len=max_query_len)
    assert_close(direct, ref, batch, FIXED.dtype)
    np.testing.assert_array_equal(direct.view(np.uint32), merged.view(np.uint32))

    def launches(b: Batch) -> int:  # Triton kernels of the step as lowered for an H200
        from tests.kernels.test_lowering import lower_for_h200

        specs = (b.q, b.kv_kernel, LAYER, b.query_start_loc, b.seq_lens, b.block_tables)
        fn = functools.partial(kernel.ragged_paged_attention, scale=0.125, max_query_len=max_query_len)
        return lower_for_h200(fn, *(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in specs)).count(
            "__gpu$xla.gpu.triton")

    assert launches(wide) == launches(batch) + 1  # the merge


SEGMENT = 128  # `invariant_segment` at the production KV tile's width: every 128 positions a split


def _segmented(batch: Batch, bucket: Bucket, max_query_len: int, window: int = 0) -> np.ndarray:
    return np.asarray(kernel.ragged_paged_attention(
        batch.q, batch.kv_kernel, LAYER, batch.query_start_loc, batch.seq_lens, batch.block_tables,
        scale=bucket.head_dim ** -0.5, sliding_window=jnp.int32(window), max_query_len=max_query_len,
        interpret=True, single_path=True, invariant_segment=SEGMENT), np.float32)


@pytest.mark.parametrize("max_query_len,q_lens", [(1, [1] * 5), (64, [1, 20, 2, 30])])
def test_segmented_single_path_matches_reference_with_windows(max_query_len, q_lens):
    """The batch-invariant path with long contexts in 128-position segments (decoded as splits and merged, folded
    alike in the prefill kernel) against the dense reference, contexts crossing up to three segments."""
    bucket = dataclasses.replace(FIXED, width=24)
    batch = build(bucket, q_lens, [150, 300, 360, 31, 129][:len(q_lens)], seed=13)
    args = (batch.query_start_loc, batch.seq_lens, batch.block_tables)
    for window in (0, 40, 200):
        out = _segmented(batch, bucket, max_query_len, window)
        ref = np.asarray(reference.ragged_paged_attention(
            batch.q, batch.kv_reference, LAYER, *args, scale=bucket.head_dim ** -0.5, sliding_window=jnp.int32(window),
            max_query_len=max_query_len), np.float32)
        assert_close(out, ref, batch, bucket.dtype)


@pytest.mark.parametrize("window", [0, 50, 200])
def test_segmented_decode_rows_equal_the_prefill_kernel_rows(window):
    """Production tiles over a 340-token context in 128-position segments: the last 1 or 3 tokens of a 40-token
    chunk (the prefill kernel, folding each row's segments) are bitwise the rows the decode kernel gives them in
    absolute splits and the merge, in the prefill kernel's large and small tiles, with and without a window (one
    that starts a segment later than the context)."""
    bucket = Bucket(q_heads=8, kv_heads=2, head_dim=128, width=24, dtype=jnp.bfloat16)
    chunk = build(bucket, [40], [340], seed=17)
    whole = _segmented(chunk, bucket, 256, window)
    np.testing.assert_array_equal(_segmented(chunk, bucket, 64, window), whole)
    for count in (1, 3):
        rows = _segmented(_last_rows_as_own_chunk(chunk, count), bucket, 4, window)[:count]
        np.testing.assert_array_equal(rows, whole[40 - count:40])


def test_segmented_decodes_on_a_one_segment_table_skip_the_merge_with_the_same_bits():
    """The batch-invariant decode with contexts within one segment: on a table of at most one segment's positions
    (what the engine gives such a decode step) the decode kernel writes the rows itself, bitwise the rows of the same
    batch on a table wide enough for three segments (split programs, then the merge), with one launch fewer."""
    bucket = dataclasses.replace(FIXED, width=SEGMENT // FIXED.block_size)
    batch = build(bucket, [1] * 5, [3, 17, 128, 48, 100], seed=19)
    wide = _widened(batch, 3 * SEGMENT // FIXED.block_size)
    np.testing.assert_array_equal(_segmented(batch, bucket, 1).view(np.uint32),
                                  _segmented(wide, bucket, 1).view(np.uint32))

    def launches(b: Batch) -> int:  # Triton kernels of the step as lowered for an H200
        from tests.kernels.test_lowering import lower_for_h200

        specs = (b.q, b.kv_kernel, LAYER, b.query_start_loc, b.seq_lens, b.block_tables)
        fn = functools.partial(kernel.ragged_paged_attention, scale=0.125, max_query_len=1, single_path=True,
                               invariant_segment=SEGMENT)
        return lower_for_h200(fn, *(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in specs)).count(
            "__gpu$xla.gpu.triton")

    assert launches(wide) == launches(batch) + 1  # the merge


def test_invariant_segments_are_whole_kv_tiles():
    base = default_tuning(128, 4)
    tuning = dataclasses.replace(base, invariant_segment=256).batch_invariant(1, 4, 2048)
    assert tuning.split.absolute and tuning.split.split_tokens == 256 and tuning.split.max_splits == 8
    with pytest.raises(ValueError, match="multiple of 128"):
        dataclasses.replace(base, invariant_segment=200).batch_invariant(1, 4, 2048)


def _prefetching(tuning: Tuning) -> Tuning:
    """`tuning` with both kernels (and the short step's tiles, where set) reading page ids a KV step ahead."""
    ahead = functools.partial(dataclasses.replace, prefetch_pages=True)
    short = None if tuning.short_prefill is None else ahead(tuning.short_prefill)
    return dataclasses.replace(tuning, decode=ahead(tuning.decode), prefill=ahead(tuning.prefill), short_prefill=short)


@functools.partial(jax.jit, static_argnames=("scale", "max_query_len", "tuning", "single_path", "segment"))
def _tuned(q, kv, qsl, lens, bt, window, *, scale, max_query_len, tuning, single_path, segment=None):
    return kernel.ragged_paged_attention_impl(
        q, kv, LAYER, qsl, lens, bt, scale=scale, sliding_window=window, soft_cap=None, max_query_len=max_query_len,
        interpret=True, tuning=tuning, single_path=single_path, invariant_segment=segment)


def _bits(batch: Batch, bucket: Bucket, tuning: Tuning, max_query_len: int, window: int, **mode) -> np.ndarray:
    out = _tuned(batch.q, batch.kv_kernel, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                 jnp.int32(window), scale=bucket.head_dim ** -0.5, max_query_len=max_query_len, tuning=tuning, **mode)
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("mode", [dict(single_path=False), dict(single_path=True),
                                  dict(single_path=True, segment=SEGMENT)], ids=["default", "invariant", "segments"])
def test_page_ids_read_a_step_ahead_change_no_bit(mode):
    """`KernelConfig.prefetch_pages` only moves the block-table reads a KV step earlier: production tiles over
    contexts crossing several KV tiles (and segments), decodes beside chunks, with and without a sliding window,
    give bitwise the rows of the plain loop, which match the dense reference."""
    bucket = Bucket(q_heads=8, kv_heads=2, head_dim=128, width=24, dtype=jnp.bfloat16)
    batch = build(bucket, [1, 40, 3, 1], [340, 200, 131, 17], seed=int(np.random.default_rng().integers(1 << 16)))
    base = default_tuning(128, 4)
    for window in (0, 50):
        for max_query_len in (64, 256):
            plain = _bits(batch, bucket, base, max_query_len, window, **mode)
            ahead = _bits(batch, bucket, _prefetching(base), max_query_len, window, **mode)
            np.testing.assert_array_equal(ahead.view(np.uint32), plain.view(np.uint32))
        ref = reference.ragged_paged_attention(
            batch.q, batch.kv_reference, LAYER, batch.query_start_loc, batch.seq_lens, batch.block_tables,
            scale=bucket.head_dim ** -0.5, sliding_window=jnp.int32(window), max_query_len=256)
        assert_close(ahead, np.asarray(ref, np.float32), batch, bucket.dtype)


@pytest.mark.parametrize("rows,warps", [(32, 4), (64, 4), (64, 8)])
def test_a_short_steps_tiles_change_no_bit(rows, warps):
    """`Tuning.short_prefill`: a short step's prefill tiles of other rows and warps give the rows of the default
    small tiles bit for bit (the batch-invariant mode's promise: a row's sums follow its KV tiles, not its tile's
    rows), in segments too; the tiles keep the KV width of the prefill kernel."""
    bucket = Bucket(q_heads=8, kv_heads=2, head_dim=128, width=24, dtype=jnp.bfloat16)
    batch = build(bucket, [40, 1, 20], [340, 90, 150], seed=int(np.random.default_rng().integers(1 << 16)))
    base = default_tuning(128, 4)
    tiles = dataclasses.replace(base, short_prefill=KernelConfig(block_m=rows, block_n=64, num_warps=warps,
                                                                 num_stages=2))
    assert tiles.batch_invariant(64, 4, 384).prefill == dataclasses.replace(tiles.short_prefill,
                                                                              block_n=base.prefill.block_n)
    for segment in (None, SEGMENT):
        plain = _bits(batch, bucket, base, 64, 0, single_path=True, segment=segment)
        other = _bits(batch, bucket, tiles, 64, 0, single_path=True, segment=segment)
        np.testing.assert_array_equal(other.view(np.uint32), plain.view(np.uint32))


def _apart(tuning: Tuning | None = None) -> Tuning:
    """`tuning` (default: the shipped one) with a short step's segments allowed on programs of their own."""
    return dataclasses.replace(tuning or default_tuning(128, 4), parallel_short_segments=True)


def _invariant_rows(batch: Batch, bucket: Bucket, max_query_len: int, *, window: int = 0, split: int | None = None,
                    tuning: Tuning | None = None) -> np.ndarray:
    """The batch-invariant rows in SEGMENT-position segments under `tuning`, traced afresh."""
    fn = functools.partial(kernel.ragged_paged_attention_impl, scale=bucket.head_dim ** -0.5,
                           sliding_window=jnp.int32(window), soft_cap=None, max_query_len=max_query_len,
                           interpret=True, tuning=tuning, single_path=True, invariant_segment=SEGMENT,
                           invariant_split=split)
    args = (batch.q, batch.kv_kernel, LAYER, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    return np.asarray(jax.jit(fn)(*args), np.float32)


def _lowered_invariant(batch: Batch, max_query_len: int, tuning: Tuning) -> str:
    from tests.kernels.test_lowering import lower_for_h200

    specs = (batch.q, batch.kv_kernel, LAYER, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    fn = functools.partial(kernel.ragged_paged_attention_impl, scale=0.125, sliding_window=0, soft_cap=None,
                           max_query_len=max_query_len, interpret=False, tuning=tuning, single_path=True,
                           invariant_segment=SEGMENT)
    return lower_for_h200(fn, *(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in specs))


def test_a_short_step_over_several_segments_takes_a_program_per_segment():
    """`Tuning.parallel_short_segments`: a short chunk over a context of several segments (a prefix-cache hit's
    step) runs its segments on programs of their own and folds them in a merge launch, bitwise the rows of the
    one-program walk (the shipped default, and a long step's tiles) and of the decode kernel's splits; a step whose
    table spans one segment keeps the single launch."""
    bucket = Bucket(q_heads=8, kv_heads=2, head_dim=128, width=24, dtype=jnp.bfloat16)
    seed = int(np.random.default_rng().integers(1 << 16))
    chunk = build(bucket, [24, 1, 5], [340, 300, 133], seed=seed)
    short = _invariant_rows(chunk, bucket, 32, tuning=_apart())
    np.testing.assert_array_equal(short.view(np.uint32), _invariant_rows(chunk, bucket, 32).view(np.uint32))
    np.testing.assert_array_equal(short.view(np.uint32), _invariant_rows(chunk, bucket, 256).view(np.uint32))
    alone = build(bucket, [24], [340], seed=seed)
    last = _invariant_rows(_last_rows_as_own_chunk(alone, 1), bucket, 1)[:1]
    np.testing.assert_array_equal(last.view(np.uint32),
                                  _invariant_rows(alone, bucket, 32, tuning=_apart())[23:24].view(np.uint32))
    assert "prefill_segments" in _lowered_invariant(chunk, 32, _apart())
    assert "prefill_segments" not in _lowered_invariant(chunk, 32, default_tuning(128, 4))
    narrow = build(dataclasses.replace(bucket, width=SEGMENT // bucket.block_size), [24, 1], [100, 33], seed=3)
    assert "prefill_segments" not in _lowered_invariant(narrow, 32, _apart())


def test_a_short_step_of_many_tiles_keeps_the_one_program_walk(monkeypatch):
    """The segment-parallel prefill's scratch is bounded: past `MAX_SEGMENT_PARTIAL_BYTES` of partial rows a short
    step walks its segments in one program, with the same bits."""
    bucket = Bucket(q_heads=8, kv_heads=2, head_dim=128, width=24, dtype=jnp.bfloat16)
    batch = build(bucket, [24, 1, 5], [340, 300, 133], seed=5)
    assert "prefill_segments" in _lowered_invariant(batch, 32, _apart())
    apart = _invariant_rows(batch, bucket, 32, tuning=_apart())
    monkeypatch.setattr(kernel, "MAX_SEGMENT_PARTIAL_BYTES", 0)
    assert "prefill_segments" not in _lowered_invariant(batch, 32, _apart())
    walked = _invariant_rows(batch, bucket, 32, tuning=_apart())
    np.testing.assert_array_equal(walked.view(np.uint32), apart.view(np.uint32))


@pytest.mark.parametrize("max_query_len,q_lens", [(1, [1] * 4), (32, [1, 24, 3, 1]), (256, [1, 40, 3, 1])],
                         ids=["decodes", "short-step", "long-step"])
def test_a_decode_program_walking_several_segments_changes_no_bit(max_query_len, q_lens):
    """`invariant_split`: a decode program may walk several segments (each its own partial result, folded by the
    merge, or in the program itself when the table is one chunk): the rows are bitwise those of a program a
    segment, beside prefill rows (short steps' segments apart, long steps' walked), with and without a window."""
    bucket = Bucket(q_heads=8, kv_heads=2, head_dim=128, width=24, dtype=jnp.bfloat16)
    batch = build(bucket, q_lens, [340, 200, 131, 383], seed=int(np.random.default_rng().integers(1 << 16)))

    for window in (0, 150):
        one_a_program = _invariant_rows(batch, bucket, max_query_len, window=window)
        for split in (2 * SEGMENT, 3 * SEGMENT):  # two programs (one walks two segments), or the table in one
            for tuning in (None, _apart()):  # a short step's segments walked, or apart
                rows = _invariant_rows(batch, bucket, max_query_len, window=window, split=split, tuning=tuning)
                np.testing.assert_array_equal(rows.view(np.uint32), one_a_program.view(np.uint32))
        ref = reference.ragged_paged_attention(
            batch.q, batch.kv_reference, LAYER, batch.query_start_loc, batch.seq_lens, batch.block_tables,
            scale=bucket.head_dim ** -0.5, sliding_window=jnp.int32(window), max_query_len=max_query_len)
        assert_close(one_a_program, np.asarray(ref, np.float32), batch, bucket.dtype)


def test_a_split_must_hold_whole_segments():
    base = dataclasses.replace(default_tuning(128, 4), invariant_segment=256, invariant_split=640)
    with pytest.raises(ValueError, match="multiple of invariant_segment"):
        base.batch_invariant(1, 4, 2048)
    tuning = dataclasses.replace(base, invariant_split=1024).batch_invariant(1, 4, 2048)
    assert (tuning.split.split_tokens, tuning.split.fold, tuning.split.max_splits, tuning.split.slots) == (
        1024, 256, 2, 8)
