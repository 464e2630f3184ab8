"""The W4A16 Triton kernels (interpret mode: the split-K CUDA-core kernel, the tensor-core kernel, the dequantize +
matmul path) and the reference against a float64 matmul of the dequantized weight (packed by the tests' GPTQ-layout
packer); each kernel lowers for the H200; a 4-bit checkpoint's model through the kernels gives the reference path's
logits."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.w4a16 import W4A16Config, w4a16_matmul, w4a16_matmul_reference
from tests.conftest import fresh_seed
from tests.models.quant4_packing import quantize_checkpoint
from tests.models.test_quant4 import KERNEL_SHAPED, prompt_logits
from tests.models.quant4_packing import pack_rows

GROUP = 128


def _case(m: int, k: int, n: int, seed: int, group: int = GROUP):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, size=(k, n))
    zeros = rng.integers(0, 16, size=(k // group, n)).astype(np.float32)
    scales = rng.uniform(0.005, 0.05, size=(k // group, n)).astype(np.float32)
    x = rng.normal(size=(m, k)).astype(np.float32)
    exact = x.astype(np.float64) @ ((q - np.repeat(zeros, group, 0)) * np.repeat(scales, group, 0))
    return (jnp.asarray(x), jnp.asarray(pack_rows(q, 4)), jnp.asarray(zeros), jnp.asarray(scales)), exact


@pytest.mark.parametrize("m,k,n,cfg", [
    (1, 256, 64, W4A16Config("gemv", block_n=64, min_programs=4)),  # K split in 2
    (3, 384, 128, W4A16Config("gemv", block_n=32, min_programs=8, prefetch=True)),
    (5, 384, 128, W4A16Config("dot", block_m=16, block_n=32, block_k=128, min_programs=8)),  # split, rows masked
    (33, 512, 128, W4A16Config("dot", block_m=64, block_n=64, block_k=256, min_programs=1)),  # 2 groups a step
    (17, 256, 64, W4A16Config("dot", block_m=16, block_n=64, block_k=64, min_programs=1)),  # half a group a step
    (20, 512, 64, W4A16Config("dot", block_m=16, block_n=32, block_k=256, min_programs=4, planes=True)),
    (2, 1024, 32, W4A16Config("dot", block_m=16, block_n=32, block_k=512, min_programs=2, planes=True)),
    (40, 256, 64, W4A16Config("dequant")),
])
def test_kernel_and_reference_match_float64(m, k, n, cfg):
    seed = fresh_seed()
    args, exact = _case(m, k, n, seed)
    scale = np.abs(exact).max()
    for fn in (functools.partial(w4a16_matmul, interpret=True), w4a16_matmul_reference):
        out = np.asarray(fn(*args, group=GROUP, config=cfg))
        assert out.shape == (m, n)
        assert np.abs(out - exact).max() <= 1e-5 * scale, f"seed {seed}"


@pytest.mark.parametrize("group", [16, 32, 64, 256])
@pytest.mark.parametrize("m,cfg", [
    (1, W4A16Config("gemv", block_n=64, min_programs=4)),  # K split: each split a whole number of 128-row steps
    (3, W4A16Config("gemv", block_n=32, min_programs=1, prefetch=True)),
    (17, W4A16Config("dot", block_m=16, block_n=64, block_k=128, min_programs=1)),  # several groups a step
    (5, W4A16Config("dot", block_m=16, block_n=32, block_k=64, min_programs=8)),
])
def test_groups_other_than_128_match_float64(group, m, cfg):
    """GPTQ's 32- and 64-row groups (one zero point and scale per word row in the decode kernel) and groups of
    several steps."""
    seed = fresh_seed()
    args, exact = _case(m, 512, 128, seed, group)
    out = np.asarray(w4a16_matmul(*args, group=group, config=cfg, interpret=True))
    assert np.abs(out - exact).max() <= 1e-5 * np.abs(exact).max(), f"seed {seed}"


@pytest.mark.parametrize("k,n", [(256, 40), (200, 64)])
def test_shapes_the_kernel_cannot_tile_are_refused(k, n):
    x = np.zeros((2, k), np.float32)
    packed = np.zeros((k // 8, n), np.int32)
    zs = np.zeros((max(k // GROUP, 1), n), np.float32)
    with pytest.raises(ValueError, match="multiple"):
        w4a16_matmul(x, packed, zs, zs, group=GROUP, interpret=True)


@pytest.mark.parametrize("m,cfg", [
    (1, W4A16Config("gemv", block_n=256)),
    (4, W4A16Config("gemv", block_n=512, num_warps=8, prefetch=True)),
    (64, W4A16Config("dot", block_m=64, block_n=128, block_k=128)),
    (64, W4A16Config("dot", block_m=64, block_n=128, block_k=256, planes=True)),
    (4096, W4A16Config("dot", block_m=128, block_n=128, block_k=64, num_warps=8)),
])
def test_w4a16_lowers_for_h200(m, cfg):
    """Llama-3-8B's fused q/k/v projection: the decode kernel and the tensor-core kernel, one launch each."""
    from tests.kernels.test_lowering import S, lower_for_h200

    fn = functools.partial(w4a16_matmul, group=GROUP, config=cfg)
    text = lower_for_h200(fn, S((m, 4096), jnp.bfloat16), S((512, 6144), jnp.int32), S((32, 6144), jnp.bfloat16),
                          S((32, 6144), jnp.bfloat16))
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("group", [32, 64])
def test_small_groups_lower_for_h200(m, group):
    from tests.kernels.test_lowering import S, lower_for_h200

    fn = functools.partial(w4a16_matmul, group=group)
    g = 4096 // group
    text = lower_for_h200(fn, S((m, 4096), jnp.bfloat16), S((512, 6144), jnp.int32), S((g, 6144), jnp.float16),
                          S((g, 6144), jnp.float16))
    assert text.count("__gpu$xla.gpu.triton") == 1


def test_model_through_the_kernel_matches_the_reference_path(build_checkpoint, monkeypatch):
    """GPTQ with activation order, group 128: every projection runs through the kernel (interpret mode), prompt
    logits within 1e-5 · max|ref| of the CPU reference path's (unpack, then one matmul)."""
    from transformers import LlamaConfig

    model_dir, _ = build_checkpoint(LlamaConfig(**KERNEL_SHAPED))
    quantize_checkpoint(model_dir, "gptq", group=GROUP, symmetric=False, desc_act=True)
    reference, params = prompt_logits(model_dir)
    assert params["layers"][0]["wqkv"].impl == "reference"
    monkeypatch.setattr("jengine.models.quant4_place.int4_impl", lambda platform: "pallas_interpret")
    kernel, params = prompt_logits(model_dir)
    assert params["layers"][0]["w_down"].impl == "pallas_interpret"
    for ours, ref in zip(kernel, reference, strict=True):
        assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("tokens,launches", [(1, 1), (64, 1), (4096, 0)])
def test_linear_on_a_packed_weight_lowers_to_the_kernel_for_h200(tokens, launches):
    """`linear()` on an `Int4Weight` of the GPU implementation (activation order included): one Triton call for
    decode and batch rows; a prefill chunk dequantizes and takes XLA's matmul instead."""
    from jengine.layers.linear import linear
    from jengine.layers.quant4 import Int4Weight
    from tests.kernels.test_lowering import S, lower_for_h200

    def project(x, packed, zeros, scales, perm):
        return linear(x, Int4Weight(packed, zeros, scales, perm, GROUP, "pallas"))

    text = lower_for_h200(project, S((tokens, 4096), jnp.bfloat16), S((512, 6144), jnp.int32),
                          S((32, 6144), jnp.float16), S((32, 6144), jnp.float16), S((4096,), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == launches


def test_a_weights_kernel_configs_override_the_default():
    """A benchmark's sweep winner reaches the kernel: 4096 rows through the tensor-core kernel, 1 through gemv."""
    from jengine.layers.quant4 import Int4Weight, kernel_config

    tiled = W4A16Config("dot", block_m=128, block_n=128, block_k=64)
    w = Int4Weight(None, None, None, None, GROUP, "pallas", configs=((16, W4A16Config("gemv")), (8192, tiled)))
    assert kernel_config(w, 4096) == tiled
    assert kernel_config(w, 1).method == "gemv"
    assert kernel_config(Int4Weight(None, None, None, None), 4096).method == "dequant"
