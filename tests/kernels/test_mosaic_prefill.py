"""The Mosaic GPU prefill kernel, in Mosaic GPU's interpreter on the CPU and lowered for an abstract H200.

Its requests (at least 64 new tokens) and the Triton kernels' (the rest, written into its output in place) are
checked together against the pure-jnp reference, on the poisoned batches of `batches.py`: NaN in every cache slot
no request owns (the kernel reads whole pages, so the slots past a request's length are in its last step), NaN
padding queries."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import kernel, mosaic_prefill, reference
from pallas_kernels.ragged_paged_attention.tuning import MosaicConfig, default_tuning
from tests.kernels.batches import Bucket, build
from tests.kernels.test_lowering import S, i32, lower_for_h200
from tests.kernels.test_ragged_paged_attention import assert_close

LAYER = 1
# GQA 2, d=64, 16-position pages; 64-wide KV steps, so a 180-position context crosses three of them
BUCKET = Bucket(num_tokens=320, num_seqs=5, width=12, q_heads=4, kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
TUNING = dataclasses.replace(default_tuning(64, 2), mosaic_prefill=MosaicConfig(block_kv=64))
# persistent: three programs taking every (head, tile) item in turn (`mosaic_prefill.INTERPRET_PROGRAMS`)
PERSISTENT = dataclasses.replace(TUNING, mosaic_prefill=MosaicConfig(block_kv=64, persistent=True))
# a long prompt over a cached prefix, one just over a compute group, one of exactly a group, a short chunk, a decode
Q_LENS, SEQ_LENS = [150, 70, 64, 20, 1], [180, 70, 130, 20, 99]


@functools.partial(jax.jit, static_argnames=("max_query_len", "soft_cap", "single_path", "tuning"))
def _attend(q, kv, qsl, lens, bt, window, *, max_query_len, soft_cap=None, single_path=False, tuning=TUNING):
    return kernel.ragged_paged_attention_impl(
        q, kv, LAYER, qsl, lens, bt, scale=BUCKET.head_dim ** -0.5, sliding_window=window, soft_cap=soft_cap,
        max_query_len=max_query_len, interpret=True, tuning=tuning, single_path=single_path)


@pytest.mark.parametrize("window,soft_cap,tuning", [(0, None, TUNING), (50, 2.0, TUNING), (0, None, PERSISTENT),
                                                    (50, 2.0, PERSISTENT)], ids=["plain", "window_cap",
                                                                                 "persistent", "persistent_window_cap"])
def test_mosaic_and_triton_rows_together_match_the_reference(window, soft_cap, tuning):
    batch = build(BUCKET, Q_LENS, SEQ_LENS, seed=window + tuning.mosaic_prefill.persistent)
    args = (batch.query_start_loc, batch.seq_lens, batch.block_tables)
    out = _attend(batch.q, batch.kv_kernel, *args, jnp.int32(window), max_query_len=max(Q_LENS), soft_cap=soft_cap,
                  tuning=tuning)
    ref = reference.ragged_paged_attention(batch.q, batch.kv_reference, LAYER, *args,
                                           scale=BUCKET.head_dim ** -0.5, sliding_window=window, soft_cap=soft_cap,
                                           max_query_len=max(Q_LENS))
    assert_close(np.asarray(out, np.float32), np.asarray(ref, np.float32), batch, BUCKET.dtype)


def test_tile_table_covers_each_long_request_latest_tile_first():
    qsl = jnp.asarray([0, 300, 370, 380, 444], jnp.int32)  # 300, 70, 10 (not served), 64 new tokens
    num_tiles, seq, q0 = mosaic_prefill.tile_table(qsl, num_tokens=460)
    real = np.asarray(seq) < 4
    assert list(zip(np.asarray(seq)[real], np.asarray(q0)[real])) == [(0, 256), (0, 128), (0, 0), (1, 0), (3, 0)]
    assert num_tiles >= real.sum()


def _lowered(single_path: bool) -> str:
    fn = functools.partial(kernel.ragged_paged_attention_impl, scale=0.088, soft_cap=30.0, max_query_len=4096,
                           interpret=False, tuning=default_tuning(128, 4, hopper=True), single_path=single_path)
    return lower_for_h200(
        lambda q, kv, layer, qsl, lens, bt, window: fn(q, kv, layer, qsl, lens, bt, sliding_window=window),
        S((4096, 32, 128), jnp.bfloat16), S((32, 20000, 16, 2, 8, 128), jnp.bfloat16), S((), i32),
        S((9,), i32), S((8,), i32), S((8, 2048), i32), S((), i32))


def test_prefill_steps_lower_to_the_mosaic_kernel_and_the_deterministic_mode_keeps_triton():
    assert default_tuning(128, 4).mosaic_prefill is None  # not Hopper: the Triton prefill alone
    text = _lowered(single_path=False)
    assert "mosaic_gpu" in text and "__gpu$xla.gpu.triton" in text  # long requests; short ones, decodes, merge
    assert "mosaic_gpu" not in _lowered(single_path=True)
