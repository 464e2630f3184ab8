"""The step's host inputs travel as one packed buffer (`runner/host_pack.py`): inside a jitted function every field
comes back bit for bit, with its dtype, shape and weak type, and equal layouts share one compiled program."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.runner.host_pack import Packed, pack, unpack


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Inputs:
    ids: np.ndarray
    table: np.ndarray
    temps: np.ndarray
    flags: np.ndarray
    empty: np.ndarray
    half: np.ndarray
    wide: np.ndarray
    scalar: float
    on_device: jax.Array
    missing: np.ndarray | None
    width: int = dataclasses.field(default=0, metadata=dict(static=True))


def random_inputs(rng: np.random.Generator, tokens: int) -> Inputs:
    return Inputs(
        ids=rng.integers(-2**31, 2**31 - 1, tokens, dtype=np.int32),
        table=rng.integers(0, 1000, (3, 5), dtype=np.int32),
        temps=rng.standard_normal(tokens).astype(np.float32) * np.float32(1e30),  # extreme bits survive
        flags=rng.random(7) < 0.5,  # 7 bools: the next field starts unaligned unless padded
        empty=np.zeros((0, 4), np.int32),
        half=rng.standard_normal((2, 3)).astype(jnp.bfloat16),
        wide=rng.integers(-5, 5, 3, dtype=np.int64),  # jit narrows 64-bit leaves (x64 off); pack must too
        scalar=0.5,
        on_device=jnp.asarray(rng.standard_normal(4), jnp.float32),
        missing=None,
        width=3,
    )


@jax.jit
def through(packed):
    return unpack(packed)


@jax.jit
def directly(tree):
    return tree


def test_every_field_comes_back_bit_for_bit():
    rng = np.random.default_rng()
    original = random_inputs(rng, int(rng.integers(1, 40)))
    packed = pack(original)
    assert isinstance(packed, Packed) and isinstance(packed.buffer, np.ndarray)
    assert len(jax.tree_util.tree_leaves(packed)) == 3  # the buffer, the device array and the Python float
    got, want = through(packed), directly(original)
    assert got.width == 3 and got.missing is None
    for name in ("ids", "table", "temps", "flags", "empty", "half", "wide", "on_device"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8), err_msg=name)
    assert got.scalar.weak_type and got.scalar == 0.5  # a Python scalar keeps its weak type: it is not packed


def test_equal_layouts_share_one_program_and_new_shapes_compile():
    @jax.jit
    def total(packed):
        tree = unpack(packed)
        return tree.ids.sum() + tree.table.sum()

    rng = np.random.default_rng()
    first, second = random_inputs(rng, 9), random_inputs(rng, 9)
    assert int(total(pack(first))) == int(first.ids.astype(np.int32).sum(dtype=np.int32) + first.table.sum())
    assert int(total(pack(second))) == int(second.ids.sum(dtype=np.int32) + second.table.sum())
    assert total._cache_size() == 1
    total(pack(random_inputs(rng, 10)))
    assert total._cache_size() == 2


def test_unpack_leaves_an_unpacked_tree_alone():
    tree = {"a": jnp.arange(3)}
    assert unpack(tree) is tree


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.float16, np.uint32, np.float32])
def test_each_width_round_trips(dtype):
    rng = np.random.default_rng()
    values = rng.integers(0, 255, (4, 3)).astype(dtype)
    got = through(pack({"x": values, "pad": np.ones(1, np.bool_)}))["x"]
    assert got.dtype == values.dtype
    np.testing.assert_array_equal(np.asarray(got), values)
