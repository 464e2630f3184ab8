"""The 8-bit matmuls (`layers/quant.py`) against float64 numpy on the dequantized weights, for every scheme, at few
tokens (the decode shapes) and at many (past the batched-group path's limit), ragged K included.

Tolerances, `max|ours − ref| ≤ tol · max|ref|`: the reference implementation and the Pallas decode kernel 1e-5; the
device math with float8 activations 8e-2 (3 mantissa bits, per-token or per-128-group scales), int8 activations
2e-2, weight-only 1e-5.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jengine.layers.linear import linear
from jengine.layers.quant import (GROUPED_MAX_TOKENS, WEIGHT_ONLY_MAX_TOKENS, QuantizedWeight, QuantScheme,
                                 quantize_activations)

TOL = {"reference": 1e-5, "fp8": 8e-2, "int8": 2e-2, None: 1e-5}
SCHEMES = {
    "fp8-channel": QuantScheme("fp8", "fp8"),
    "fp8-block": QuantScheme("fp8", "fp8", 32, 32, 32),
    "fp8-block-per-column": QuantScheme("fp8", "fp8", 32, 1, 32),
    "fp8-weight-only": QuantScheme("fp8", None),
    "int8-w8a8": QuantScheme("int8", "int8"),
    "int8-w8a16-channel": QuantScheme("int8", None),
    "int8-w8a16-group": QuantScheme("int8", None, 16, 1),
    "int8-w8a8-block-per-token": QuantScheme("int8", "int8", 32, 32),
}


def random_quantized(rng, scheme: QuantScheme, k: int, n: int, static: float | None = None):
    """Random 8-bit values and positive scales of the scheme's block shape; returns the weight and its float64
    dequantization, computed here from the same numbers."""
    kg = 1 if scheme.block_k == 0 else -(-k // scheme.block_k)
    ng = -(-n // scheme.block_n)
    scale = rng.uniform(0.5, 2.0, (kg, ng)).astype(np.float32) / 100
    if scheme.weight_dtype == "fp8":
        values = np.clip(rng.normal(0, 100, (k, n)), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    else:
        values = rng.integers(-127, 128, (k, n)).astype(np.int8)
    rows = k if scheme.block_k == 0 else scheme.block_k
    full = np.repeat(np.repeat(scale.astype(np.float64), rows, 0), scheme.block_n, 1)[:k, :n]
    q = QuantizedWeight.from_kn(jnp.asarray(values), jnp.asarray(scale),
                                None if static is None else jnp.float32(static), scheme)
    return q, values.astype(np.float64) * full


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas_interpret"])
@pytest.mark.parametrize("tokens", [1, 8, GROUPED_MAX_TOKENS + 9])
@pytest.mark.parametrize("name", SCHEMES)
def test_quantized_matmul_matches_the_dequantized_weight(name, tokens, impl):
    rng = np.random.default_rng(zlib.crc32(f"{name}{tokens}".encode()))
    k, n = 80, 72  # not multiples of the 32-wide blocks: partial edge blocks
    q, real = random_quantized(rng, dataclass_replace(SCHEMES[name], impl=impl), k, n)
    x = rng.normal(0, 1, (tokens, k)).astype(np.float32)
    ours = np.asarray(jax.jit(linear)(jnp.asarray(x), q))
    ref = x.astype(np.float64) @ real
    pallas = impl == "pallas_interpret" and q.scheme.block_k == 0 and tokens <= 16  # the kernel: weight-only math
    tol = TOL["reference"] if impl == "reference" or pallas else TOL[q.scheme.activations]
    assert np.abs(ours - ref).max() <= tol * np.abs(ref).max()


def test_a_static_activation_scale_is_used_as_given():
    rng = np.random.default_rng(0)
    q, real = random_quantized(rng, QuantScheme("fp8", "fp8", impl="xla"), 64, 32, static=0.01)
    x = rng.normal(0, 1, (WEIGHT_ONLY_MAX_TOKENS + 4, 64)).astype(np.float32)  # past the weight-only decode sizes
    ours = np.asarray(linear(jnp.asarray(x), q))
    # x / 0.01 reaches 448 at 4.48: every |x| here is smaller, so the only error is float8's rounding of x
    x8 = (x / np.float32(0.01)).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 0.01
    assert np.abs(ours - x8 @ real).max() <= 1e-5 * np.abs(x8 @ real).max()


def test_activation_quantization_clips_instead_of_overflowing_to_nan():
    x = jnp.asarray([[1e4, -3.0, 0.5, 0.0]], jnp.float32)
    for kind in ("fp8", "int8"):
        xq, scale = quantize_activations(x, kind, static_scale=jnp.float32(1.0))
        assert np.isfinite(np.asarray(xq.astype(jnp.float32))).all()
        assert float(xq.astype(jnp.float32)[0, 0]) == (448.0 if kind == "fp8" else 127.0)


def dataclass_replace(scheme: QuantScheme, **changes) -> QuantScheme:
    import dataclasses

    return dataclasses.replace(scheme, **changes)


@pytest.mark.parametrize("weight_dtype", [jnp.float8_e4m3fn, jnp.int8])
def test_the_decode_kernel_lowers_for_h200(weight_dtype):
    """The Triton lowering's own checks (interpret mode lets more through), on a Llama-3-8B q/k/v projection."""
    from pallas_kernels.quant_matmul import few_token_matmul
    from tests.kernels.test_lowering import S, lower_for_h200

    text = lower_for_h200(few_token_matmul, S((1, 4096), jnp.bfloat16), S((6144, 4096), weight_dtype),
                          S((6144,), jnp.float32))
    assert text.count("__gpu$xla.gpu.triton") == 1
    split = lower_for_h200(functools.partial(few_token_matmul, block_n=128, block_k=128, k_splits=4),
                           S((16, 14336), jnp.bfloat16), S((4096, 14336), weight_dtype), S((4096,), jnp.float32))
    assert split.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("k_splits", [2, 3, 64])
def test_the_decode_kernel_split_over_k_matches_float64(rows, k_splits):
    """K split across programs (float32 partial sums added afterwards), with a K that leaves the last split short
    and more splits asked than K has steps: the same product as the unsplit math."""
    from pallas_kernels.quant_matmul import few_token_matmul

    rng = np.random.default_rng(zlib.crc32(f"split{rows}{k_splits}".encode()))
    k, n = 200, 48  # 7 steps of 32 with a ragged last one; 3 splits are 3 + 3 + 1 steps, 64 become 7 of one
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scale = rng.uniform(0.5, 2.0, n).astype(np.float32) / 100
    x = rng.normal(0, 1, (rows, k)).astype(np.float32)
    ours = np.asarray(few_token_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(scale), block_n=16, block_k=32,
                                       k_splits=k_splits, interpret=True))
    ref = (x.astype(np.float64) @ w.astype(np.float64).T) * scale
    assert ours.shape == (rows, n)
    assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("tokens", [1, 8, GROUPED_MAX_TOKENS + 9])
@pytest.mark.parametrize("name", [n for n, s in SCHEMES.items() if s.activations is not None])
def test_emulated_reference_rounds_activations_as_the_device_math(name, tokens):
    """The `emulated` oracle of the GPU checks: only the accumulation order separates it from the device math, an
    error far below the activations' own 8-bit rounding (which the plain reference keeps and `TOL` allows)."""
    rng = np.random.default_rng(zlib.crc32(f"emulated{name}{tokens}".encode()))
    k, n = 80, 72
    x = jnp.asarray(rng.normal(0, 1, (tokens, k)).astype(np.float32))
    q, real = random_quantized(rng, dataclass_replace(SCHEMES[name], impl="xla"), k, n)
    device = np.asarray(jax.jit(linear)(x, q), np.float64)
    emulated = np.asarray(jax.jit(linear)(x, dataclasses.replace(q, scheme=dataclass_replace(q.scheme,
                                                                                          impl="emulated"))))
    exact = np.asarray(x, np.float64) @ real
    scale = np.abs(exact).max()
    assert np.abs(device - emulated).max() <= 1e-4 * scale
    if q.scheme.weight_dtype == "fp8" and tokens <= WEIGHT_ONLY_MAX_TOKENS:  # decode-sized: weight-only math
        assert np.abs(device - exact).max() <= 1e-5 * scale
    else:
        assert np.abs(device - exact).max() > 1e-3 * scale  # the activations' rounding is there, and emulated has it


@pytest.mark.parametrize("tokens", [1, GROUPED_MAX_TOKENS + 9])
@pytest.mark.parametrize("name", ["fp8-channel", "fp8-block"])
def test_bfloat16_activations_through_the_fp8_gemm(name, tokens):
    """bfloat16 activations (what serving runs): the FP8 GEMM's bfloat16 output, scaled afterwards, keeps the
    float8 error bound (`TOL`) against float64 on the same bfloat16 inputs."""
    rng = np.random.default_rng(zlib.crc32(f"bf16{name}{tokens}".encode()))
    k, n = 80, 72
    q, real = random_quantized(rng, dataclass_replace(SCHEMES[name], impl="xla"), k, n)
    x = jnp.asarray(rng.normal(0, 1, (tokens, k)).astype(np.float32)).astype(jnp.bfloat16)
    ours = np.asarray(jax.jit(linear)(x, q).astype(jnp.float32))
    ref = np.asarray(x.astype(jnp.float32), np.float64) @ real
    assert ours.dtype == np.float32 and np.abs(ours - ref).max() <= TOL["fp8"] * np.abs(ref).max()
