"""The Mosaic GPU weight-only kernel (`pallas_kernels/weight_only`) in Mosaic GPU's interpreter against a float64
numpy reference, on fresh random weights, scales and activations each run; its register-operand form lowered for an
H200 (what the GPU runs; the interpreter runs the shared-memory form); and the engine's use of it: `Int4Weight`'s
`mosaic` layout (conversion, TP splits, a loaded checkpoint's logits) and the 8-bit `mosaic` implementation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.weight_only.kernel import WeightOnlyConfig, persistent_splits, weight_only_matmul
from tests.kernels.test_lowering import S, lower_for_h200

INTERPRET = plgpu.InterpretGPUParams()
RANGES = {"int4": (-8, 8), "int8": (-128, 128), "float8_e4m3fn": (-448, 449)}


def _reference(x, q, scales, zeros=None) -> np.ndarray:
    n, k = q.shape
    groups = scales.shape[0]
    q = q.astype(np.float64).reshape(n, groups, k // groups)
    if zeros is not None:
        q = q - zeros.astype(np.float64).T[:, :, None]
    w = q * scales.astype(np.float64).T[:, :, None]
    return x.astype(np.float64) @ w.reshape(n, k).T


def _case(rng, m, k, n, groups, dtype):
    lo, hi = RANGES[dtype]
    x = rng.standard_normal((m, k)).astype(np.float32)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # exactly what the kernel reads
    q = rng.integers(lo, hi, (n, k))
    if dtype == "float8_e4m3fn":  # the float8 values those numbers round to, spread over the type's whole range
        q = np.asarray(jnp.asarray(q * rng.uniform(0.0, 1.0, q.shape), jnp.float8_e4m3fn).astype(jnp.float32))
    scales = rng.uniform(0.5, 2.0, (groups, n)).astype(np.float32) / (hi * np.sqrt(k))
    return x, q, scales


def _run(x, q, scales, dtype, config, zeros=None):
    zeros = None if zeros is None else jnp.asarray(zeros)
    return np.asarray(weight_only_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(q, getattr(jnp, dtype)),
                                         jnp.asarray(scales), zeros, config=config, interpret=INTERPRET), np.float64)


@pytest.mark.parametrize("dtype,m,k,n,groups,tile_n,block_k,min_programs,resident_x", [
    ("int4", 1, 512, 128, 4, 64, 128, 0, False),  # decode row, group 128: a scale per step
    ("int4", 13, 768, 192, 3, 64, 128, 6, False),  # odd rows (padded to 16), groups of 256 over two steps, K in 3
    ("int4", 2, 1024, 256, 8, 128, 256, 4, False),  # two groups a step, two row tiles a program, K split in 2
    ("int8", 5, 512, 64, 1, 64, 128, 4, False),  # per-channel: one group, K split in 4
    ("int8", 40, 256, 128, 1, 128, 256, 0, False),  # wide step, rows past one 8-column tile
    ("float8_e4m3fn", 3, 512, 128, 1, 64, 256, 2, False),  # float8 per channel: products in float16, rows rescaled
    ("int4", 1, 1024, 128, 8, 64, 128, 4, True),  # the activations resident: each split's own range, step by step
    ("int4", 13, 768, 192, 3, 64, 128, 6, True),  # ... over groups of two steps, odd rows
    ("float8_e4m3fn", 3, 512, 128, 1, 64, 256, 2, True),
])
def test_matches_float64_reference(dtype, m, k, n, groups, tile_n, block_k, min_programs, resident_x):
    rng = np.random.default_rng()
    x, q, scales = _case(rng, m, k, n, groups, dtype)
    cfg = WeightOnlyConfig(tile_n=tile_n, block_k=block_k, min_programs=min_programs, max_concurrent_steps=2,
                           staged=True, resident_x=resident_x)
    got, ref = _run(x, q, scales, dtype, cfg), _reference(x, q, scales)
    # bfloat16 output: half an ulp of rounding, plus float32 accumulation in another order
    np.testing.assert_allclose(got, ref, rtol=2 ** -8, atol=1e-3 * np.abs(ref).max())


WARP_SPECIALIZED = dict(warp_specialized=True)


@pytest.mark.parametrize("dtype,m,k,n,groups,zero_points,form", [
    # two compute warpgroups and a memory one, group scales
    ("int4", 1, 512, 256, 4, False, dict(tile_n=128, block_k=128, min_programs=0, **WARP_SPECIALIZED)),
    # odd rows, groups over two steps, K split in 3, zero points
    ("int4", 13, 768, 256, 3, True, dict(tile_n=128, block_k=128, min_programs=6, **WARP_SPECIALIZED)),
    # one compute warpgroup, per channel, K split in 4
    ("int8", 5, 512, 64, 1, False, dict(tile_n=64, block_k=128, min_programs=4, **WARP_SPECIALIZED)),
    ("float8_e4m3fn", 3, 512, 128, 1, False, dict(tile_n=128, block_k=128, min_programs=2, **WARP_SPECIALIZED)),
    # persistent programs, each running several work items through one pipeline: every item's sums start from
    # zero and land in its own output columns and range. 8 items (K split in 4) over 3 programs: the last repeated
    ("int4", 1, 512, 128, 4, False, dict(tile_n=64, block_k=128, persistent=3)),
    # groups of two steps, 15 items over 4 programs, zero points
    ("int4", 13, 768, 320, 3, True, dict(tile_n=64, block_k=128, persistent=4)),
    # two row tiles an item, per channel
    ("int8", 5, 512, 256, 1, False, dict(tile_n=128, block_k=128, persistent=3)),
    ("float8_e4m3fn", 3, 512, 128, 1, False, dict(tile_n=64, block_k=256, persistent=2)),
])
def test_other_program_forms_match_float64_reference(dtype, m, k, n, groups, zero_points, form):
    rng = np.random.default_rng()
    x, q, scales = _case(rng, m, k, n, groups, dtype)
    zeros = rng.integers(-8, 8, (groups, n)).astype(np.float32) if zero_points else None
    cfg = WeightOnlyConfig(max_concurrent_steps=2, staged=True, **form)
    got, ref = _run(x, q, scales, dtype, cfg, zeros=zeros), _reference(x, q, scales, zeros)
    np.testing.assert_allclose(got, ref, rtol=2 ** -8, atol=1e-3 * np.abs(ref).max())


@pytest.mark.parametrize("steps,tiles,programs,per_group,expected", [
    (16, 448, 132, 1, 2),  # gate/up at 64 features a tile: 448 items fill 85 % of four waves, 896 97 % of seven
    (16, 96, 132, 1, 4),  # qkv: 96 and 192 items fill 73 %, 384 97 %
    (56, 64, 132, 1, 2),  # down: 128 items in one wave
    (6, 5, 4, 2, 3),  # ranges of whole groups (two steps) or inside one: 15 items, 94 %
    (4, 2, 3, 1, 4),  # none reaches 90 %: the busiest (8 of 9)
])
def test_persistent_splits_keep_the_programs_busy(steps, tiles, programs, per_group, expected):
    assert persistent_splits(steps, tiles, programs, per_group) == expected


def _reference_scaled_in_bfloat16(x, q, scales, zeros=None) -> np.ndarray:
    """`one_accumulator`'s arithmetic: each weight `(q − z) · s` rounded to bfloat16 (s itself rounded first), as a
    bfloat16 model's dequantized weight is, then the product in float64."""
    as_bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    n, k = q.shape
    groups = scales.shape[0]
    w = q.astype(np.float64).reshape(n, groups, k // groups)
    if zeros is not None:
        w = w - zeros.astype(np.float64).T[:, :, None]
    w = as_bf16((w * as_bf16(scales).T[:, :, None]).reshape(n, k))
    return x.astype(np.float64) @ w.T


@pytest.mark.parametrize("dtype,m,k,n,groups,tile_n,block_k,min_programs,resident_x,zero_points", [
    ("int4", 1, 512, 128, 4, 64, 128, 0, False, False),  # group scales into the weights, one accumulator
    ("int4", 13, 768, 192, 3, 64, 128, 6, False, True),  # groups over two steps, split in 3, zero points
    ("int4", 2, 1024, 256, 8, 128, 256, 4, True, False),  # two groups a step, two row tiles, activations resident
    ("int8", 5, 512, 64, 1, 64, 128, 4, False, False),  # per channel: scaled after the kernel
    ("float8_e4m3fn", 3, 512, 128, 1, 64, 256, 2, False, False),
])
def test_one_accumulator_matches_its_reference(dtype, m, k, n, groups, tile_n, block_k, min_programs, resident_x,
                                               zero_points):
    rng = np.random.default_rng()
    x, q, scales = _case(rng, m, k, n, groups, dtype)
    zeros = rng.integers(-8, 8, (groups, n)).astype(np.float32) if zero_points else None
    cfg = WeightOnlyConfig(tile_n=tile_n, block_k=block_k, min_programs=min_programs, max_concurrent_steps=2,
                           staged=True, resident_x=resident_x, one_accumulator=True)
    got = _run(x, q, scales, dtype, cfg, zeros=zeros)
    ref = (_reference_scaled_in_bfloat16 if groups > 1 else _reference)(x, q, scales, zeros)
    np.testing.assert_allclose(got, ref, rtol=2 ** -8, atol=1e-3 * np.abs(ref).max())


def test_zero_points_shift_each_groups_weights():
    """AWQ's asymmetric groups: unsigned nibbles u with zero points z' become q = u − 8, z = z' − 8."""
    rng = np.random.default_rng()
    m, k, n, groups = 3, 512, 128, 4
    x, _, scales = _case(rng, m, k, n, groups, "int4")
    u, z_unsigned = rng.integers(0, 16, (n, k)), rng.integers(0, 16, (groups, n))
    cfg = WeightOnlyConfig(tile_n=128, block_k=256, min_programs=2, staged=True)
    got = _run(x, u - 8, scales, "int4", cfg, zeros=(z_unsigned - 8).astype(np.float32))
    ref = _reference(x, u, scales, zeros=z_unsigned)
    np.testing.assert_allclose(got, ref, rtol=2 ** -8, atol=1e-3 * np.abs(ref).max())


def test_each_group_takes_its_own_scale():
    """A scale change in one group moves only that group's share of the output (a wrong group index would not)."""
    rng = np.random.default_rng()
    x, q, scales = _case(rng, 2, 512, 64, 4, "int4")
    cfg = WeightOnlyConfig(min_programs=0, staged=True)
    base = _run(x, q, scales, "int4", cfg)
    bumped = scales.copy()
    bumped[2] *= 3.0
    delta = _run(x, q, bumped, "int4", cfg) - base
    share = x[:, 256:384].astype(np.float64) @ (q[:, 256:384] * scales[2][:, None]).T
    # two bfloat16 outputs' roundings (half an ulp each) on top of the share
    np.testing.assert_allclose(delta, 2.0 * share, rtol=2 ** -7, atol=2 ** -8 * np.abs(base).max())


@pytest.mark.parametrize("m,k,n,groups", [(1, 4096, 128, 3), (2, 4096, 100, 32), (300, 4096, 128, 32),
                                         (1, 4096, 128, 128)])  # groups of 32 inputs: below a wgmma chunk
def test_rejects_shapes_it_cannot_tile(m, k, n, groups):
    with pytest.raises(ValueError):
        weight_only_matmul(jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((n, k), jnp.int4),
                           jnp.ones((groups, n), jnp.float32), interpret=INTERPRET)


@pytest.mark.parametrize("cfg", [WeightOnlyConfig(warp_specialized=True, persistent=132),
                                 WeightOnlyConfig(persistent=132, one_accumulator=True),
                                 WeightOnlyConfig(warp_specialized=True, resident_x=True)])
def test_rejects_forms_that_do_not_combine(cfg):
    with pytest.raises(ValueError, match="no other form"):
        weight_only_matmul(jnp.zeros((1, 512), jnp.bfloat16), jnp.zeros((128, 512), jnp.int4),
                           jnp.ones((4, 128), jnp.float32), config=cfg)


@pytest.mark.parametrize("dtype,m,groups,zeros,cfg", [
    (jnp.int4, 1, 32, False, WeightOnlyConfig()),
    (jnp.int4, 64, 32, True, WeightOnlyConfig(tile_n=128, block_k=512)),
    (jnp.int8, 16, 1, False, WeightOnlyConfig(block_k=256)),
    (jnp.float8_e4m3fn, 1, 1, False, WeightOnlyConfig()),
    (jnp.int4, 1, 32, True, WeightOnlyConfig(block_k=256, max_concurrent_steps=8, min_programs=528, resident_x=True)),
    (jnp.int8, 8, 1, False, WeightOnlyConfig(block_k=256, resident_x=True)),
    (jnp.int4, 1, 32, True, WeightOnlyConfig(block_k=256, max_concurrent_steps=8, min_programs=528,
                                             one_accumulator=True)),  # the activations' slots released a step late
    (jnp.int4, 16, 32, False, WeightOnlyConfig(tile_n=128, block_k=256, one_accumulator=True, resident_x=True)),
    (jnp.float8_e4m3fn, 1, 1, False, WeightOnlyConfig(one_accumulator=True)),
    (jnp.int4, 1, 32, True, WeightOnlyConfig(tile_n=128, block_k=256, max_concurrent_steps=8, warp_specialized=True)),
    (jnp.int8, 64, 1, False, WeightOnlyConfig(block_k=256, warp_specialized=True)),
    (jnp.int4, 1, 32, True, WeightOnlyConfig(block_k=256, max_concurrent_steps=8, persistent=132)),
    (jnp.float8_e4m3fn, 16, 1, False, WeightOnlyConfig(tile_n=128, persistent=264)),
])
def test_register_operand_form_lowers_for_h200(dtype, m, groups, zeros, cfg):
    fn = functools.partial(weight_only_matmul, config=cfg)
    # a checkpoint's float16 scales and zero points, read as stored
    specs = [S((m, 4096), jnp.bfloat16), S((6144, 4096), dtype), S((groups, 6144), jnp.float16)]
    text = lower_for_h200(fn, *specs, *([S((groups, 6144), jnp.float16)] if zeros else []))
    assert "mosaic_gpu" in text


def _int4_weight(rng, k: int, n: int, group: int = 128, perm: bool = False):
    """A words-layout `Int4Weight` (the Triton kernels' interpret form) of random nibbles, zero points, scales."""
    from jengine.layers.quant4 import Int4Weight
    from tests.models.quant4_packing import pack_rows

    q = rng.integers(0, 16, size=(k, n))
    zeros = rng.integers(0, 16, size=(k // group, n)).astype(np.float32)
    scales = rng.uniform(0.005, 0.05, size=(k // group, n)).astype(np.float32)
    order = jnp.asarray(rng.permutation(k), jnp.int32) if perm else None
    return Int4Weight(jnp.asarray(pack_rows(q, 4)), jnp.asarray(zeros, jnp.float16), jnp.asarray(scales, jnp.float16),
                      order, group, "pallas_interpret")


@pytest.mark.parametrize("rows,perm", [(1, False), (7, True), (80, False)])
def test_an_int4_weight_in_the_mosaic_layout_multiplies_as_its_words(rows, perm):
    """`to_mosaic` keeps the weight (its dequantized form equal) and `linear()` through the Mosaic kernel (decode
    rows; 80 rows dequantize for cuBLAS) matches the float64 product within bfloat16 rounding. The dequantized path
    multiplies the weight rounded to bfloat16, a relative error of up to 2⁻⁹ a weight that 512 products sum to
    several times the kernel's: its reference rounds the weight the same way."""
    from jengine.layers.linear import linear
    from jengine.layers.quant4 import MOSAIC_MAX_ROWS, dequantize4, to_mosaic

    rng = np.random.default_rng()
    words = _int4_weight(rng, 512, 192, perm=perm)
    mosaic = to_mosaic(words, interpret=True)
    assert mosaic.impl == "mosaic_interpret" and mosaic.shape == words.shape == (512, 192)
    assert mosaic.nbytes == words.nbytes  # half a byte a weight in both layouts
    exact = np.asarray(dequantize4(words), np.float64)
    np.testing.assert_array_equal(np.asarray(dequantize4(mosaic)), exact)
    x = jnp.asarray(rng.standard_normal((rows, 512)), jnp.bfloat16)
    multiplied = exact if rows <= MOSAIC_MAX_ROWS else np.asarray(jnp.asarray(exact, jnp.bfloat16), np.float64)
    ref = np.asarray(x, np.float64) @ multiplied
    got = np.asarray(linear(x, mosaic), np.float64)
    np.testing.assert_allclose(got, ref, rtol=2 ** -7, atol=2e-3 * np.abs(ref).max())


@pytest.mark.parametrize("split", ["columns", "rows"])
def test_a_split_int4_weight_converts_on_its_devices(split):
    """Over 2 devices each keeps its share through the conversion (output features for a column split, whole
    groups of inputs for a row split), and the sharded product equals the one-device product (rows past the
    kernel's, so the per-device dequantized path runs: the interpreter runs one device's kernel at a time)."""
    import dataclasses

    from jax.sharding import NamedSharding, PartitionSpec as P

    from jengine.layers.linear import linear
    from jengine.layers.quant4 import MOSAIC_MAX_ROWS, to_mosaic

    mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng()
    one = _int4_weight(rng, 512, 256)
    spec = P(None, "tp") if split == "columns" else P("tp", None)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
    placed = dataclasses.replace(one, packed=put(one.packed), zeros=put(one.zeros), scales=put(one.scales),
                                 mesh=mesh, split=split)
    mosaic = to_mosaic(placed, interpret=True)
    axis = 0 if split == "columns" else 1
    assert mosaic.packed.addressable_shards[0].data.shape[axis] * 2 == mosaic.packed.shape[axis]
    x = jnp.asarray(rng.standard_normal((MOSAIC_MAX_ROWS + 8, 512)), jnp.bfloat16)
    want = np.asarray(linear(x, to_mosaic(one, interpret=True)), np.float32)
    # a row split adds bfloat16 partial products: an ulp of the largest output apart at most
    np.testing.assert_allclose(np.asarray(linear(x, mosaic), np.float32), want, rtol=2 ** -7,
                               atol=2 ** -7 * np.abs(want).max())


@pytest.mark.parametrize("kind,acts,rows", [("int8", None, 1), ("int8", None, 12), ("int8", None, 70),
                                            ("fp8", None, 5), ("fp8", "fp8", 3)])
def test_an_8bit_weight_only_projection_takes_the_mosaic_kernel(kind, acts, rows):
    """Per-channel int8 or float8 weight-only steps (`QuantScheme` impl `mosaic_interpret`; float8 W8A8 at decode
    rows runs weight-only, as on XLA's path) match the reference implementation's float32 product within bfloat16
    rounding: decode rows through the kernel, 70 rows through XLA's path."""
    from jengine.layers.quant import QuantizedWeight, QuantScheme, quantized_matmul

    rng = np.random.default_rng()
    k, n = 384, 192
    if kind == "int8":
        weight = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
    else:
        weight = jnp.asarray(rng.uniform(-448, 448, (k, n)), jnp.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, (1, n)).astype(np.float32) / (127 * np.sqrt(k))
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)

    def product(impl):
        q = QuantizedWeight.from_kn(weight, jnp.asarray(scale), None, QuantScheme(kind, acts, impl=impl))
        return np.asarray(quantized_matmul(x, q), np.float64)

    ref = np.asarray(x, np.float64) @ (np.asarray(weight.astype(jnp.float32), np.float64) * scale)
    np.testing.assert_allclose(product("mosaic_interpret"), ref, rtol=2 ** -7, atol=2e-3 * np.abs(ref).max())
    np.testing.assert_allclose(product("reference"), ref, rtol=2 ** -7, atol=2e-3 * np.abs(ref).max())


def test_a_checkpoint_loads_into_the_mosaic_layout_and_serves_its_logits(build_checkpoint, monkeypatch):
    """AWQ (asymmetric, group 128) loaded with the Mosaic implementation: every projection lands in its layout and
    the bfloat16 prompt logits (decode-sized prompts through the kernel) stay within bfloat16's noise of the
    reference path's (unpack, dequantize to bfloat16, one matmul)."""
    from transformers import LlamaConfig

    from jengine.runner.simple import SimpleGenerator
    from jengine.layers.quant4 import Int4Weight
    from jengine.models.loader import load_model
    from tests.models.quant4_packing import quantize_checkpoint
    from tests.models.test_quant4 import KERNEL_SHAPED, PROMPTS

    model_dir, _ = build_checkpoint(LlamaConfig(**KERNEL_SHAPED))
    quantize_checkpoint(model_dir, "awq", group=128)

    def logits():
        spec, params, dtype = load_model(model_dir, dtype="bfloat16", progress=False)
        out = SimpleGenerator(spec, params, dtype, block_size=4).generate(PROMPTS, 1, return_prompt_logits=True)
        return out.prompt_logits, params["layers"][0]

    reference, _ = logits()
    monkeypatch.setattr("jengine.models.quant4_place.int4_impl", lambda platform: "mosaic_interpret")
    ours, layer = logits()
    assert all(isinstance(layer[name], Int4Weight) and layer[name].nk for name in
               ("wqkv", "wo", "w_gate_up", "w_down"))
    for got, want in zip(ours, reference, strict=True):
        assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()


@pytest.mark.parametrize("kind,acts,rows,kernel", [("int8", None, 1, True), ("fp8", "fp8", 16, True),
                                                  ("fp8", "fp8", 17, False), ("int8", None, 65, False),
                                                  ("int8", "int8", 1, False)])
def test_the_mosaic_implementation_lowers_decode_rows_to_the_kernel_for_h200(kind, acts, rows, kernel):
    """Which steps of a `mosaic` 8-bit weight reach the kernel on an H200: weight-only decode rows (float8 W8A8 up to
    the rows that run weight-only); more rows, or int8 activations, stay on XLA's path."""
    from jengine.layers.quant import QuantizedWeight, QuantScheme, quantized_matmul

    dtype = jnp.int8 if kind == "int8" else jnp.float8_e4m3fn

    def project(x, weight, scale):
        return quantized_matmul(x, QuantizedWeight(weight, scale, None, QuantScheme(kind, acts, impl="mosaic"), 4096))

    text = lower_for_h200(project, S((rows, 4096), jnp.bfloat16), S((1, 6144, 4096), dtype),
                          S((1, 6144), jnp.float32))
    assert ("mosaic_gpu" in text) == kernel


def test_zero_points_the_kernel_cannot_subtract_exactly_keep_the_triton_layout():
    """GGUF Q4_K's zero points are arbitrary reals: subtracted in bfloat16 they would round, so such a weight stays
    in the words layout; eighths (a dummy model's 7.5) are exact and convert."""
    from jengine.models.quant4_place import exact_in_bfloat16, in_kernel_layout

    assert exact_in_bfloat16(np.array([[0.0, 7.5, 15.0, 3.125]]))
    assert not exact_in_bfloat16(np.array([[7.3]]))
    words = _int4_weight(np.random.default_rng(), 256, 128)
    assert in_kernel_layout(words, "mosaic_interpret", exact_zeros=False).impl == "pallas_interpret"
    assert in_kernel_layout(words, "mosaic_interpret").nk


@pytest.mark.parametrize("layout", ["pallas_interpret", "mosaic_interpret"])
def test_the_kv_planner_reserves_a_4bit_weights_prefill_copy(layout):
    """Prefill-sized steps multiply a dequantized copy of a 4-bit weight on every path (words or Mosaic layout):
    the step's workspace holds the largest one, in the model dtype."""
    from jengine.layers.quant import workspace_bytes
    from jengine.layers.quant4 import to_mosaic

    rng = np.random.default_rng()
    small, large = _int4_weight(rng, 256, 128), _int4_weight(rng, 512, 192)
    if layout == "mosaic_interpret":
        small, large = to_mosaic(small, interpret=True), to_mosaic(large, interpret=True)
    assert workspace_bytes({"a": small, "b": large}, jnp.bfloat16, "gpu") == 512 * 192 * 2
