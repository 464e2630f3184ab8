"""The 32-bit offset window of Pallas' Triton lowering, read from the Triton IR it emits for an abstract H200 (no
GPU needed): `addressing.offsets_overflow` must agree with the offset width the lowering really picks, and the
kernels must refuse a cache in the window rather than read and write outside it."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as triton_dialect
from jax.experimental import pallas as pl
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels.addressing import UnsupportedShapeError, offsets_overflow
from pallas_kernels.kv_write import kernel as kv_write
from pallas_kernels.ragged_paged_attention import kernel as attention

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
S = jax.ShapeDtypeStruct
ROW = 256  # the probe reads the last row of a [num_elements / ROW, ROW] array, by a dynamic row index


def _read_last_row(x_ref, o_ref):
    o_ref[...] = x_ref[x_ref.shape[0] - 1 + pl.program_id(0), :].astype(jnp.float32)


def _lower(fn, *specs):
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=H200)):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))


def load_offset_bits(num_elements: int, dtype) -> int:
    """The integer width of the element offsets the lowering adds to the input's pointer."""
    call = functools.partial(pl.pallas_call, _read_last_row, grid=(1,), out_shape=S((ROW,), jnp.float32),
                             in_specs=[pl.no_block_spec], out_specs=pl.no_block_spec)
    module = _lower(lambda x: call()(x), S((num_elements // ROW, ROW), dtype)).compiler_ir()
    [triton_ir] = [ir.StringAttr(op.attributes["mhlo.backend_config"]["ir"]).value_bytes
                   for op in module.body.operations[0].regions[0].blocks[0].operations
                   if op.name == "stablehlo.custom_call"]
    with ir.Context() as context:
        triton_dialect.register_dialect(context)
        text = str(ir.Module.parse(triton_ir))
    element = jnp.dtype(dtype).name.replace("float8_e4m3fn", "f8E4M3FN").replace("bfloat16", "bf16")
    [bits] = re.findall(rf"tt\.addptr .*tensor<{ROW}x!tt\.ptr<{element}>>, tensor<{ROW}xi(\d+)>", text)
    return int(bits)


@pytest.mark.parametrize("num_elements,dtype", [
    (2**31, jnp.float8_e4m3fn),  # 2^31 elements: the last offset, 2^31 - 1, fits
    (2**31 + ROW, jnp.float8_e4m3fn),  # in the window: 32-bit offsets, the last row past int32
    (2**32, jnp.float8_e4m3fn),  # exactly 4 GiB: still 32-bit
    (2**32 + ROW, jnp.float8_e4m3fn),  # over 4 GiB: 64-bit offsets
    (2**31, jnp.bfloat16),  # 4 GiB of 2-byte elements: 32-bit offsets, the last one fits
    (2**31 + ROW, jnp.bfloat16),  # over 4 GiB: 64-bit
])
def test_overflow_rule_matches_the_lowering(num_elements, dtype):
    bits = load_offset_bits(num_elements, dtype)
    really_overflows = bits == 32 and num_elements - 1 >= 2**31
    assert offsets_overflow((num_elements,), dtype) == really_overflows, (num_elements, bits)


i32 = jnp.int32
IN_WINDOW_FP8_CACHE = S((32, 4800, 16, 2, 4, 128), jnp.float8_e4m3fn)  # 2.34 GiB


def test_attention_reads_a_float8_cache_in_the_window_through_byte_pairs():
    """A float8 cache of (2, 4] GiB lowers (its uint16 view has under 2^31 elements); it used to be refused."""
    scales = S((32, 2, 4), jnp.float32)
    attend = functools.partial(attention.ragged_paged_attention, scale=0.1, max_query_len=1)
    text = _lower(lambda q, kv, s, layer, qsl, lens, bt: attend(q, kv, layer, qsl, lens, bt, kv_scales=s),
                  S((8, 16, 128), jnp.bfloat16), IN_WINDOW_FP8_CACHE, scales, S((), i32), S((9,), i32),
                  S((8,), i32), S((8, 64), i32)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_write_kernel_refuses_a_cache_in_the_window():
    """The write kernel still stores single bytes; jengine's `write_kv` sends such a cache to the XLA scatter."""
    scales = S((32, 2, 4), jnp.float32)
    with pytest.raises(UnsupportedShapeError, match="32-bit element offsets"):
        _lower(lambda kv, layer, slots, k, v, s: kv_write.write_kv(kv, layer, slots, k, v, kv_scales=s),
               IN_WINDOW_FP8_CACHE, S((), i32), S((8,), i32), S((8, 4, 128), jnp.bfloat16),
               S((8, 4, 128), jnp.bfloat16), scales)
