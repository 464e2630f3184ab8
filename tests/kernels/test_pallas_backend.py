"""The `pallas_gpu` attention backend (kernels in interpret mode) against the reference backend, and its selection."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_quant

from jengine.attention import pallas
from jengine.attention.backend import ReferenceBackend, select_backend
from jengine.attention.kv_cache import QuantizedKV
from jengine.attention.metadata import AttentionMetadata
from jengine.errors import ConfigError
from tests.kernels.batches import Bucket, build

BUCKET = Bucket(q_heads=8, kv_heads=2)  # the shapes test_ragged_paged_attention compiles too


def step_inputs(bucket: Bucket, q_lens, seq_lens, seed=0):
    batch = build(bucket, q_lens, seq_lens, seed=seed)
    rng = np.random.default_rng(seed + 1)
    num_slots = bucket.num_blocks * bucket.block_size
    slots = np.full(bucket.num_tokens, num_slots, np.int32)
    positions = np.zeros(bucket.num_tokens, np.int32)
    tables, t = np.asarray(batch.block_tables), 0
    for b, (q, s) in enumerate(zip(q_lens, seq_lens)):
        for p in range(s - q, s):
            slots[t], positions[t] = tables[b, p // bucket.block_size] * bucket.block_size + p % bucket.block_size, p
            t += 1
    md = AttentionMetadata(jnp.asarray(positions), jnp.asarray(slots), batch.query_start_loc, batch.seq_lens,
                           batch.block_tables, bucket.num_tokens)
    new = rng.standard_normal((2, bucket.num_tokens, bucket.kv_heads, bucket.head_dim)).astype(np.float32)
    q = jnp.nan_to_num(batch.q)
    return q, jnp.asarray(new[0]), jnp.asarray(new[1]), batch.kv_reference, md, batch.num_real_tokens


@pytest.mark.parametrize("kernel_write", [False, True])
def test_backend_matches_reference_backend(monkeypatch, kernel_write):
    if kernel_write:
        monkeypatch.setattr(pallas, "KV_WRITE_KERNEL_MIN_TOKENS", 1)
    q, k, v, kv, md, n = step_inputs(BUCKET, [1, 20, 1, 9], [40, 20, 160, 70])
    kw = dict(scale=BUCKET.head_dim ** -0.5, sliding_window=jnp.int32(0), soft_cap=None)
    out, cache = pallas.PallasGpuBackend(interpret=True)(q, k, v, jnp.array(kv), 1, md, **kw)
    ref_out, ref_cache = ReferenceBackend()(q, k, v, jnp.array(kv), 1, md, **kw)
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(ref_cache))
    np.testing.assert_allclose(np.asarray(out[:n]), np.asarray(ref_out[:n]), atol=2e-5, rtol=2e-5)


def test_unsupported_head_dim_falls_back_to_reference(caplog):
    bucket = Bucket(q_heads=4, kv_heads=2, head_dim=48, num_tokens=8, num_seqs=2, width=2)
    q, k, v, kv, md, n = step_inputs(bucket, [1, 3], [5, 3])
    kw = dict(scale=0.1, sliding_window=0, soft_cap=None)
    with caplog.at_level(logging.WARNING, logger="jengine.attention.pallas"):
        out, _ = pallas.PallasGpuBackend(interpret=True)(q, k, v, kv, 0, md, **kw)
    ref_out, _ = ReferenceBackend()(q, k, v, kv, 0, md, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    assert "head_dim=48" in caplog.text


def test_an_invariant_backend_refuses_a_model_its_kernels_cannot_run():
    """`deterministic=True` cannot keep its promise on the reference path a GPU would fall back to: refused, named."""
    bucket = Bucket(q_heads=4, kv_heads=2, head_dim=48, num_tokens=8, num_seqs=2, width=2)
    q, k, v, kv, md, _ = step_inputs(bucket, [1, 3], [5, 3])
    with pytest.raises(ConfigError, match="deterministic=True needs the pallas_gpu attention kernels"):
        pallas.PallasGpuBackend(interpret=True, invariant=True)(q, k, v, kv, 0, md, scale=0.1, sliding_window=0,
                                                                soft_cap=None)


def test_selection_by_platform_and_head_dim(caplog):
    assert select_backend("cpu").name == "reference"
    assert select_backend("gpu").name == "pallas_gpu"
    assert select_backend("gpu", head_dim=128).name == "pallas_gpu"
    assert select_backend("cpu", "pallas_gpu").name == "pallas_gpu"  # asked by name: taken as asked
    with caplog.at_level(logging.WARNING, logger="jengine.attention.backend"):
        assert select_backend("gpu", head_dim=96).name == "reference"
    assert "96" in caplog.text


def test_deterministic_takes_one_attention_path_or_is_refused():
    assert select_backend("gpu", deterministic=True).invariant  # pallas_gpu: every row through one kernel
    assert not select_backend("gpu").invariant
    assert select_backend("cpu", deterministic=True).name == "reference"  # invariant on the CPU (tested)
    with pytest.raises(ConfigError, match="deterministic=True needs the pallas_gpu"):
        select_backend("gpu", head_dim=96, deterministic=True)  # XLA's attention on a GPU is not batch-invariant
    with pytest.raises(ConfigError, match="deterministic=True needs the pallas_gpu"):
        select_backend("gpu", "reference", deterministic=True)


@pytest.mark.parametrize("kernel_write", [False, True])
def test_fp8_backend_matches_reference_backend(monkeypatch, kernel_write):
    """A float8 cache through both backends: the same bytes written (Pallas write or scatter, both quantizing with
    the cache's scales), outputs within float32 rounding of each other, scales passed through untouched."""
    if kernel_write:
        monkeypatch.setattr(pallas, "KV_WRITE_KERNEL_MIN_TOKENS", 1)
    q, k, v, kv, md, n = step_inputs(BUCKET, [1, 20, 1, 9], [40, 20, 160, 70])
    rng = np.random.default_rng(3)
    scales = jnp.asarray(rng.uniform(0.005, 0.02, (BUCKET.layers, 2, BUCKET.kv_heads)), jnp.float32)
    fp8 = kv_quant.quantize(kv, (1.0 / scales)[:, None, None, :, :, None])
    kw = dict(scale=BUCKET.head_dim ** -0.5, sliding_window=jnp.int32(0), soft_cap=None)
    out, cache = pallas.PallasGpuBackend(interpret=True)(q, k, v, QuantizedKV(jnp.array(fp8), scales), 1, md, **kw)
    ref_out, ref_cache = ReferenceBackend()(q, k, v, QuantizedKV(jnp.array(fp8), scales), 1, md, **kw)
    assert isinstance(cache, QuantizedKV) and cache.kv.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(cache.kv).view(np.uint8), np.asarray(ref_cache.kv).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(cache.scales), np.asarray(scales))
    np.testing.assert_allclose(np.asarray(out[:n]), np.asarray(ref_out[:n]), atol=2e-5, rtol=2e-5)


H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def kernel_launches_for_h200(cache_blocks: int, cache_dtype) -> int:
    """The backend's step for an abstract H200 with a float8 (or other) cache of `cache_blocks` 16-token blocks of
    32 layers × 4 KV heads × 128: how many Triton kernels it launches (0: the reference path)."""
    S = jax.ShapeDtypeStruct
    tokens, seqs = 64, 64
    cache = S((32, cache_blocks, 16, 2, 4, 128), cache_dtype)
    kv = QuantizedKV(cache, S((32, 2, 4), jnp.float32)) if cache_dtype == jnp.float8_e4m3fn else cache
    i32 = jnp.int32
    md = AttentionMetadata(S((tokens,), i32), S((tokens,), i32), S((seqs + 1,), i32), S((seqs,), i32),
                           S((seqs, 256), i32), 1)
    qkv = [S((tokens, h, 128), jnp.bfloat16) for h in (16, 4, 4)]
    step = functools.partial(pallas.PallasGpuBackend(), scale=0.1, sliding_window=jnp.int32(0), soft_cap=None)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(step).trace(*qkv, kv, S((), i32), md).lower(lowering_platforms=("cuda",))
    return lowered.as_text().count("__gpu$xla.gpu.triton")


def test_gpu_float8_caches_of_every_size_run_the_kernels():
    """Lowered for an H200 (no GPU needed): a float8 cache of (2, 4] GiB per device, whose single bytes the Triton
    lowering's 32-bit offsets cannot address, runs the attention kernel through its byte-pair view (it used to take
    the reference path), as do float8 caches on either side of that window and a bfloat16 one."""
    assert kernel_launches_for_h200(4800, jnp.float8_e4m3fn) > 0  # 2.34 GiB
    assert kernel_launches_for_h200(3000, jnp.float8_e4m3fn) > 0  # 1.46 GiB
    assert kernel_launches_for_h200(9000, jnp.float8_e4m3fn) > 0  # 4.39 GiB: 64-bit offsets
    assert kernel_launches_for_h200(4800, jnp.bfloat16) > 0  # 4.69 GiB


@pytest.mark.parametrize("kernel_write", [False, True])
def test_fp8_backend_under_a_tensor_parallel_mesh(monkeypatch, kernel_write):
    """On a 2-device mesh the kernels run per device under shard_map: the float8 cache's scales travel split by KV
    head with the pages (each device reads its own heads' scales); the K/V write by either path."""
    if kernel_write:
        monkeypatch.setattr(pallas, "KV_WRITE_KERNEL_MIN_TOKENS", 1)
    q, k, v, kv, md, n = step_inputs(BUCKET, [1, 20, 1, 9], [40, 20, 160, 70], seed=4)
    scales = jnp.asarray(np.random.default_rng(4).uniform(0.005, 0.02, (BUCKET.layers, 2, BUCKET.kv_heads)),
                         jnp.float32)
    fp8 = kv_quant.quantize(kv, (1.0 / scales)[:, None, None, :, :, None])
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    kw = dict(scale=BUCKET.head_dim ** -0.5, sliding_window=jnp.int32(0), soft_cap=None)
    backend = pallas.PallasGpuBackend(interpret=True, mesh=mesh)
    out, cache = jax.jit(lambda *a: backend(*a, **kw))(q, k, v, QuantizedKV(jnp.array(fp8), scales), 1, md)
    ref_out, ref_cache = ReferenceBackend()(q, k, v, QuantizedKV(jnp.array(fp8), scales), 1, md, **kw)
    np.testing.assert_array_equal(np.asarray(cache.kv).view(np.uint8), np.asarray(ref_cache.kv).view(np.uint8))
    np.testing.assert_allclose(np.asarray(out[:n]), np.asarray(ref_out[:n]), atol=2e-5, rtol=2e-5)


def test_the_invariant_segment_reaches_the_kernels_only_in_the_invariant_mode(monkeypatch):
    """`backend.INVARIANT_SEGMENT` (512 positions, more for a context of over 16 of them; decode programs of 2048):
    the deterministic backend carries it, the default one does not, and a segmented invariant backend's rows match
    the reference backend's over contexts crossing its 128-position segments."""
    from jengine.attention import backend as backend_module

    shipped = select_backend("gpu", deterministic=True)
    assert (shipped.invariant_segment, shipped.invariant_split, shipped.parallel_short_segments) == (512, 2048, True)
    monkeypatch.setattr(backend_module, "SHORT_STEP_SEGMENTS_APART", False)
    assert not select_backend("gpu", deterministic=True).parallel_short_segments
    # at most 16 segments over max_model_len: the decode grid's split axis and partial outputs stay bounded
    long_context = select_backend("gpu", deterministic=True, max_model_len=131072)
    assert (long_context.invariant_segment, long_context.invariant_split) == (8192, 8192)
    assert [backend_module.invariant_segment_for(n) for n in (None, 2048, 8192, 8704, 32768, 33024)] == [
        512, 512, 512, 1024, 2048, 4096]
    monkeypatch.setattr(backend_module, "INVARIANT_SEGMENT", None)
    assert select_backend("gpu", deterministic=True).invariant_segment is None
    monkeypatch.setattr(backend_module, "INVARIANT_SEGMENT", 128)
    fine = select_backend("gpu", deterministic=True)  # finer segments, decode programs as wide as before
    assert (fine.invariant_segment, fine.invariant_split, fine.one_split_positions(False)) == (128, 2048, 2048)
    assert select_backend("gpu").invariant_segment is None
    q, k, v, kv, md, n = step_inputs(BUCKET, [1, 20, 1, 9], [40, 20, 160, 150])
    kw = dict(scale=BUCKET.head_dim ** -0.5, sliding_window=jnp.int32(0), soft_cap=None)
    ref_out, _ = ReferenceBackend()(q, k, v, jnp.array(kv), 1, md, **kw)
    for split in (None, 256):
        segmented = pallas.PallasGpuBackend(interpret=True, invariant=True, invariant_segment=128,
                                            invariant_split=split)
        out, _ = segmented(q, k, v, jnp.array(kv), 1, md, **kw)
        np.testing.assert_allclose(np.asarray(out[:n]), np.asarray(ref_out[:n]), atol=2e-5, rtol=2e-5)
