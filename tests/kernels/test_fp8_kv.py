"""The float8 (e4m3) KV cache in the kernels (interpret mode): attention against an independent float64 oracle on the
dequantized cache, fp8 against the bf16 kernel, the quantizing write against its reference and the format's rule.

Random inputs are drawn fresh each run (the seed is in every failure message).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.kv_quant import FP8_DTYPE, FP8_MAX, quantize
from pallas_kernels.kv_write import kernel as write_kernel
from pallas_kernels.kv_write import reference as write_reference
from pallas_kernels.ragged_paged_attention import kernel, reference
from pallas_kernels.ragged_paged_attention.tuning import Tuning, default_tuning
from tests.conftest import fresh_seed
from tests.kernels.batches import Batch, Bucket, build

SEED = fresh_seed()
LAYER = 1


def amax_scales(kv: np.ndarray) -> np.ndarray:
    """Per-(layer, K/V, KV head) scales mapping the largest owned value to 448 (NaN marks slots nobody owns)."""
    return (np.nanmax(np.abs(kv), axis=(1, 2, 5)) / FP8_MAX).astype(np.float32)


def to_fp8(batch: Batch) -> tuple[jnp.ndarray, jnp.ndarray, np.ndarray]:
    """(fp8 cache keeping the NaN poison, scales, dequantized cache in float64 with zeros where nobody owns)."""
    values = np.asarray(batch.kv_kernel, np.float32)
    scales = amax_scales(values)
    inv = (1.0 / scales)[:, None, None, :, :, None]
    cache = quantize(jnp.asarray(values), jnp.asarray(inv))
    deq = np.asarray(cache.astype(jnp.float32), np.float64) * scales[:, None, None, :, :, None]
    return cache, jnp.asarray(scales), np.nan_to_num(deq)


def attention_f64(q, kv, layer, qsl, seq_lens, tables, *, scale, window=0, soft_cap=None) -> np.ndarray:
    """Plain numpy float64 paged attention, one request at a time: the oracle independent of both jnp paths."""
    q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)[layer]
    qsl, seq_lens, tables = (np.asarray(a) for a in (qsl, seq_lens, tables))
    block_size, kv_heads = kv.shape[1], kv.shape[3]
    group = q.shape[1] // kv_heads
    out = np.zeros_like(q)
    for b in range(len(seq_lens)):
        n_q, n = qsl[b + 1] - qsl[b], seq_lens[b]
        if n_q == 0:
            continue
        pages = kv[tables[b]].reshape(-1, 2, kv_heads, kv.shape[-1])[:n]
        k = np.repeat(pages[:, 0], group, axis=1)  # [n, q_heads, d]
        v = np.repeat(pages[:, 1], group, axis=1)
        qb = q[qsl[b]:qsl[b + 1]]
        s = np.einsum("thd,nhd->htn", qb, k) * scale
        if soft_cap:
            s = soft_cap * np.tanh(s / soft_cap)
        q_pos = np.arange(n - n_q, n)[:, None]
        k_pos = np.arange(n)[None, :]
        visible = (k_pos <= q_pos) & ((window <= 0) | (k_pos > q_pos - window))
        s = np.where(visible[None], s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[qsl[b]:qsl[b + 1]] = np.einsum("htn,nhd->thd", p, v)
    return out


def run_kernel(batch: Batch, cache, scales, *, max_query_len, window=0, soft_cap=None, fp8_operands=None):
    if fp8_operands is None:
        return kernel.ragged_paged_attention(
            batch.q, cache, LAYER, batch.query_start_loc, batch.seq_lens, batch.block_tables, kv_scales=scales,
            scale=batch.q.shape[-1] ** -0.5, sliding_window=jnp.int32(window), soft_cap=soft_cap,
            max_query_len=max_query_len, interpret=True)
    q_heads, head_dim = batch.q.shape[1:]
    group = q_heads // cache.shape[4]
    tuning = dataclasses.replace(default_tuning(head_dim, group, quantized=True), fp8_operands=fp8_operands)
    return kernel.ragged_paged_attention_impl(
        batch.q, cache, LAYER, batch.query_start_loc, batch.seq_lens, batch.block_tables, kv_scales=scales,
        scale=head_dim ** -0.5, sliding_window=jnp.int32(window), soft_cap=soft_cap, max_query_len=max_query_len,
        interpret=True, tuning=tuning)


# (bucket, q_lens, seq_lens, window, soft_cap, max_query_len): a decode-only bucket (split-K + merge), a mixed step
# with a prefill chunk (both kernels), a window and a soft cap; float32 queries keep the kernel's own arithmetic
# exact enough for a tight bound, bf16 queries round the probabilities to bf16 (the bf16 tolerance).
FIXED = Bucket(q_heads=8, kv_heads=2)
CASES = {
    "decode-f32": (FIXED, [1] * 6, [1, 16, 17, 100, 160, 33], 0, None, 1),
    "mixed-f32-window": (FIXED, [60, 1, 1, 1, 1], [60, 90, 5, 31, 32], 20, None, 64),
    "mixed-bf16-cap-d128": (Bucket(q_heads=4, kv_heads=2, head_dim=128, width=5, dtype=jnp.bfloat16),
                            [1, 20, 1, 9], [40, 20, 80, 70], 0, 30.0, 64),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp8_kernel_matches_float64_reference_on_dequantized_cache(name):
    bucket, q_lens, seq_lens, window, soft_cap, max_query_len = CASES[name]
    batch = build(bucket, q_lens, seq_lens, seed=SEED)
    cache, scales, deq = to_fp8(batch)
    out = np.asarray(run_kernel(batch, cache, scales, max_query_len=max_query_len, window=window,
                                soft_cap=soft_cap), np.float64)
    ref = attention_f64(np.asarray(batch.q, np.float32), deq, LAYER, batch.query_start_loc, batch.seq_lens,
                        batch.block_tables, scale=bucket.head_dim ** -0.5, window=window, soft_cap=soft_cap)
    n = batch.num_real_tokens
    tol = 2e-2 if bucket.dtype == jnp.bfloat16 else 2e-5
    assert np.isfinite(out).all(), f"NaN: an unowned slot was read (seed {SEED})"
    np.testing.assert_allclose(out[:n], ref[:n], atol=tol, rtol=tol, err_msg=f"seed {SEED}")
    assert (out[n:] == 0).all()


BF16_CASES = {
    "mixed-bf16-cap-d128": CASES["mixed-bf16-cap-d128"],
    "decode-bf16-window": (Bucket(q_heads=8, kv_heads=2, head_dim=64, width=5, dtype=jnp.bfloat16),
                           [1] * 5, [3, 40, 17, 70, 64], 24, None, 1),
}


@pytest.mark.parametrize("name", sorted(BF16_CASES))
@pytest.mark.parametrize("magnitude", [1.0, 3e4], ids=["unit", "large-query"])
def test_float16_operands_match_float64_reference(name, magnitude):
    """`Tuning.fp8_operands="float16"`: the tensor cores take float16 K, V, probabilities and a query scaled by
    2^-4 (a query of 3e4, past half of float16's range, stays finite); as close to float64 as bfloat16 operands
    (2e-2), and closer to the bfloat16-operand kernel than that bound."""
    bucket, q_lens, seq_lens, window, soft_cap, max_query_len = BF16_CASES[name]
    batch = build(bucket, q_lens, seq_lens, seed=SEED)
    batch = dataclasses.replace(batch, q=(batch.q.astype(jnp.float32) * magnitude).astype(batch.q.dtype))
    cache, scales, deq = to_fp8(batch)
    run = functools.partial(run_kernel, batch, cache, scales, max_query_len=max_query_len, window=window,
                            soft_cap=soft_cap)
    out = np.asarray(run(fp8_operands="float16"), np.float64)
    ref = attention_f64(np.asarray(batch.q, np.float32), deq, LAYER, batch.query_start_loc, batch.seq_lens,
                        batch.block_tables, scale=bucket.head_dim ** -0.5, window=window, soft_cap=soft_cap)
    n = batch.num_real_tokens
    assert np.isfinite(out).all(), f"seed {SEED}"
    np.testing.assert_allclose(out[:n], ref[:n], atol=2e-2, rtol=2e-2, err_msg=f"seed {SEED}")
    bf16_operands = np.asarray(run(fp8_operands="bfloat16"), np.float64)
    np.testing.assert_allclose(out[:n], bf16_operands[:n], atol=2e-2, rtol=2e-2, err_msg=f"seed {SEED}")
    assert (out[n:] == 0).all()


def test_operand_types_are_checked():
    base = default_tuning(128, 4, quantized=True)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        Tuning(base.decode, base.prefill, base.split, fp8_operands="float8")


def test_jnp_reference_dequantizes_like_the_float64_oracle():
    batch = build(FIXED, [1, 17, 5], [40, 17, 100], seed=SEED)
    cache, scales, deq = to_fp8(batch)
    zeroed = jnp.where(jnp.isnan(cache.astype(jnp.float32)), 0, cache).astype(FP8_DTYPE)
    ref = reference.ragged_paged_attention(batch.q, zeroed, LAYER, batch.query_start_loc, batch.seq_lens,
                                           batch.block_tables, kv_scales=scales, scale=0.125, max_query_len=64)
    oracle = attention_f64(batch.q, deq, LAYER, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                           scale=0.125)
    n = batch.num_real_tokens
    np.testing.assert_allclose(np.asarray(ref[:n]), oracle[:n], atol=2e-5, rtol=2e-5, err_msg=f"seed {SEED}")


DECODE = Bucket(num_tokens=8, num_seqs=8, width=40, q_heads=8, kv_heads=2, head_dim=128, dtype=jnp.bfloat16)
# fp8 against bf16, relative error ||fp8 − bf16|| / ||bf16|| over the decode rows, standard-normal q, K, V. Measured
# here: 0.035-0.04 (e4m3's 3-bit mantissa alone leaves 2.6 % RMS error per stored value: V's error passes straight
# into the output and K's error perturbs unit-variance logits by as much again), so the bound is 5e-2, not 3e-2.
FP8_VS_BF16_BOUND = 5e-2


def test_fp8_decode_is_close_to_the_bf16_kernel():
    rng = np.random.default_rng(SEED)
    seq_lens = rng.integers(DECODE.max_context // 2, DECODE.max_context, DECODE.num_seqs).tolist()
    batch = build(DECODE, [1] * DECODE.num_seqs, seq_lens, seed=SEED)
    cache, scales, _ = to_fp8(batch)
    fp8 = np.asarray(run_kernel(batch, cache, scales, max_query_len=1), np.float64)
    bf16 = np.asarray(run_kernel(batch, batch.kv_kernel, None, max_query_len=1), np.float64)
    rel = np.linalg.norm(fp8 - bf16) / np.linalg.norm(bf16)
    assert rel <= FP8_VS_BF16_BOUND, f"fp8 vs bf16 relative error {rel:.4f} (seed {SEED})"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantizing_write_matches_reference_and_the_format_rule(dtype):
    rng = np.random.default_rng(SEED)
    layers, blocks, block_size, kv_heads, head_dim, tokens = 2, 6, 16, 2, 64, 21
    num_slots = blocks * block_size
    cache = jnp.asarray(rng.standard_normal((layers, blocks, block_size, 2, kv_heads, head_dim)), FP8_DTYPE)
    scales = rng.uniform(0.01, 0.1, (layers, 2, kv_heads)).astype(np.float32)
    slots = rng.choice(num_slots, tokens, replace=False).astype(np.int32)
    slots[-4:] = num_slots  # padding tokens
    k = rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float32)
    k[0, 0, :4] = [1e4, -1e4, 500 * scales[1, 0, 0], 0.0]  # beyond the e4m3 range: saturate to ±448, never NaN
    v = rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float32)
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)

    ours = write_kernel.write_kv(jnp.array(cache), 1, slots, k, v, kv_scales=jnp.asarray(scales), interpret=True)
    ref = write_reference.write_kv(jnp.array(cache), 1, slots, k, v, kv_scales=jnp.asarray(scales))
    np.testing.assert_array_equal(np.asarray(ours).view(np.uint8), np.asarray(ref).view(np.uint8))

    stored = np.asarray(ours.astype(jnp.float32))[1].reshape(num_slots, 2, kv_heads, head_dim)[slots[:-4]]
    new = np.stack([np.asarray(k, np.float32), np.asarray(v, np.float32)], axis=1)[:-4]
    inv = np.float32(1) / scales[1][None, :, :, None]  # the rule: times the float32 reciprocal, clip, round
    expected = np.clip(new * inv, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(stored, expected.astype(np.float32))  # ml_dtypes' own e4m3 rounding
    assert np.isfinite(stored).all()
    assert stored[0, 0, 0, :3].tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX]
    untouched = np.asarray(cache.astype(jnp.float32))[0]
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32))[0], untouched)  # layer 0 untouched


def test_scales_are_required_for_fp8_and_refused_otherwise():
    q = jnp.zeros((4, 4, 64))
    i = jnp.zeros(1, jnp.int32)
    args = (0, jnp.zeros(2, jnp.int32), i, jnp.zeros((1, 2), jnp.int32))
    fp8 = jnp.zeros((2, 4, 16, 2, 2, 64), FP8_DTYPE)
    with pytest.raises(ValueError, match="needs kv_scales"):
        kernel.ragged_paged_attention(q, fp8, *args, scale=1.0, max_query_len=1, interpret=True)
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        kernel.ragged_paged_attention(q, fp8, *args, kv_scales=jnp.ones((2, 2)), scale=1.0, max_query_len=1,
                                      interpret=True)
    with pytest.raises(ValueError, match="only used with a float8"):
        reference.ragged_paged_attention(q, fp8.astype(jnp.float32), *args, kv_scales=jnp.ones((2, 2, 2)),
                                         scale=1.0, max_query_len=1)
    kv = jnp.zeros((1, 2, 64))
    with pytest.raises(ValueError, match="needs kv_scales"):
        write_kernel.write_kv(fp8, 0, jnp.zeros(1, jnp.int32), kv, kv, interpret=True)


def test_a_float8_caches_segments_fold_alike_whichever_program_walks_them():
    """The batch-invariant mode over a float8 cache (two column parts a tile): a short step's segments on programs
    of their own, a decode program walking two segments and a long step's one-program walk give the rows of one
    program a segment bit for bit, within the float64 reference's tolerance of the dequantized cache."""
    bucket = Bucket(q_heads=8, kv_heads=2, head_dim=128, width=24, dtype=jnp.bfloat16)
    batch = build(bucket, [1, 24, 3, 1], [340, 200, 131, 383], seed=SEED)
    cache, scales, deq = to_fp8(batch)
    args = (batch.q, cache, LAYER, batch.query_start_loc, batch.seq_lens, batch.block_tables)

    apart = dataclasses.replace(default_tuning(128, 4, quantized=True), parallel_short_segments=True)

    def rows(max_query_len: int, split: int | None, tuning: Tuning | None = None) -> np.ndarray:
        fn = functools.partial(kernel.ragged_paged_attention_impl, kv_scales=scales, scale=bucket.head_dim ** -0.5,
                               sliding_window=0, soft_cap=None, max_query_len=max_query_len, interpret=True,
                               tuning=tuning, single_path=True, invariant_segment=128, invariant_split=split)
        return np.asarray(jax.jit(fn)(*args), np.float32)

    base = rows(32, None)
    for max_query_len, split, tuning in ((32, None, apart), (32, 256, apart), (256, None, None), (256, 384, None)):
        np.testing.assert_array_equal(rows(max_query_len, split, tuning).view(np.uint32), base.view(np.uint32),
                                      err_msg=f"seed {SEED}")
    ref = attention_f64(np.asarray(batch.q, np.float32), deq, LAYER, batch.query_start_loc, batch.seq_lens,
                        batch.block_tables, scale=bucket.head_dim ** -0.5)
    n = batch.num_real_tokens
    np.testing.assert_allclose(base[:n], ref[:n], atol=2e-2, rtol=2e-2, err_msg=f"seed {SEED}")
