"""The W4A16 Triton kernel (interpret mode) and its reference against a float64 matmul of the dequantized weight
(packed by the tests' GPTQ-layout packer); both tile shapes lower for the H200; a 4-bit checkpoint's model through
the kernel gives the reference path's logits."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.w4a16 import w4a16_matmul, w4a16_matmul_reference
from tests.conftest import fresh_seed
from tests.models.quant4_packing import quantize_checkpoint
from tests.models.test_quant4 import KERNEL_SHAPED, prompt_logits
from tests.models.quant4_packing import pack_rows

GROUP = 128


def _case(m: int, k: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, size=(k, n))
    zeros = rng.integers(0, 16, size=(k // GROUP, n)).astype(np.float32)
    scales = rng.uniform(0.005, 0.05, size=(k // GROUP, n)).astype(np.float32)
    x = rng.normal(size=(m, k)).astype(np.float32)
    exact = x.astype(np.float64) @ ((q - np.repeat(zeros, GROUP, 0)) * np.repeat(scales, GROUP, 0))
    return (jnp.asarray(x), jnp.asarray(pack_rows(q, 4)), jnp.asarray(zeros), jnp.asarray(scales)), exact


@pytest.mark.parametrize("m,k,n,block_m,block_n", [(1, 256, 64, 16, 64), (5, 384, 128, 16, 32),
                                                   (33, 256, 128, 64, 128)])
def test_kernel_and_reference_match_float64(m, k, n, block_m, block_n):
    seed = fresh_seed()
    args, exact = _case(m, k, n, seed)
    scale = np.abs(exact).max()
    for fn in (functools.partial(w4a16_matmul, interpret=True), w4a16_matmul_reference):
        out = np.asarray(fn(*args, group=GROUP, block_m=block_m, block_n=block_n))
        assert out.shape == (m, n)
        assert np.abs(out - exact).max() <= 1e-5 * scale, f"seed {seed}"


def test_shapes_the_kernel_cannot_tile_are_refused():
    args, _ = _case(2, 256, 96, 0)
    with pytest.raises(ValueError, match="block_n"):
        w4a16_matmul(*args, group=GROUP, block_n=64, interpret=True)


@pytest.mark.parametrize("m,block_m,block_n", [(1, 16, 64), (4096, 64, 128)])
def test_w4a16_lowers_for_h200(m, block_m, block_n):
    """Llama-3-8B's fused q/k/v projection, decode and prefill tiles."""
    from tests.kernels.test_lowering import S, lower_for_h200

    fn = functools.partial(w4a16_matmul, group=GROUP, block_m=block_m, block_n=block_n)
    text = lower_for_h200(fn, S((m, 4096), jnp.bfloat16), S((512, 6144), jnp.int32), S((32, 6144), jnp.bfloat16),
                          S((32, 6144), jnp.bfloat16))
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


@pytest.mark.parametrize("tokens", [1, 4096])
def test_linear_on_a_packed_weight_lowers_to_the_kernel_for_h200(tokens):
    """`linear()` on an `Int4Weight` of the GPU implementation (activation order included): one Triton call."""
    from jengine.layers.linear import linear
    from jengine.layers.quant4 import Int4Weight
    from tests.kernels.test_lowering import S, lower_for_h200

    def project(x, packed, zeros, scales, perm):
        return linear(x, Int4Weight(packed, zeros, scales, perm, GROUP, "pallas"))

    text = lower_for_h200(project, S((tokens, 4096), jnp.bfloat16), S((512, 6144), jnp.int32),
                          S((32, 6144), jnp.float16), S((32, 6144), jnp.float16), S((4096,), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == 1
