"""Tests of the safetensors checkpoint reader and the orbax save/restore of converted parameters."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

from jengine.errors import CheckpointError
from jengine.models.checkpoint import CheckpointReader, checkpoint_dtype

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "rope_scaling": {"type": "linear", "factor": 2.0}}


def _model_dir(path: Path, config: dict | None = None) -> Path:
    """An empty model directory holding only config.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    return path


def _numpy_tensors() -> dict[str, np.ndarray]:
    """One tensor of every dtype safetensors.numpy writes, with values that catch byte-order and offset bugs."""
    rng = np.random.default_rng(0)
    return {
        "f64": rng.standard_normal((3, 5)),
        "f32": rng.standard_normal((4, 6)).astype(np.float32),
        "f16": rng.standard_normal((7,)).astype(np.float16),
        "i64": np.arange(-5, 5, dtype=np.int64).reshape(2, 5),
        "i32": np.array([[-(2**31), 2**31 - 1]], dtype=np.int32),
        "i16": np.arange(6, dtype=np.int16),
        "i8": np.array([-128, 0, 127], dtype=np.int8),
        "u8": np.array([0, 1, 255], dtype=np.uint8),
        "bool": np.array([True, False, True]),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def _raw_safetensors(path: Path, header: dict, data: bytes, header_len: int | None = None) -> None:
    """Hand-writes a safetensors file, so malformed headers can be tested."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


@pytest.fixture
def numpy_model(tmp_path: Path) -> Path:
    model = _model_dir(tmp_path / "np")
    save_numpy(_numpy_tensors(), str(model / "model.safetensors"), metadata={"format": "np"})
    return model


def test_numpy_round_trip(numpy_model: Path) -> None:
    expected = _numpy_tensors()
    with CheckpointReader(numpy_model) as reader:
        assert reader.names() == sorted(expected)
        for name, want in expected.items():
            got = reader.read(name)
            assert name in reader
            assert reader.shape(name) == want.shape == got.shape
            assert reader.dtype(name) == want.dtype == got.dtype
            np.testing.assert_array_equal(got, want)
        assert reader.nbytes_total == sum(a.nbytes for a in expected.values())
        assert reader.config() == CONFIG
        assert "nope" not in reader


def test_torch_low_precision_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tensors = {
        "bf16": torch.randn(5, 3, dtype=torch.float32).to(torch.bfloat16),
        "e4m3": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(2, 8).to(torch.float8_e5m2),
        "f32": torch.randn(3),
    }
    model = _model_dir(tmp_path / "pt")
    save_torch(tensors, str(model / "model.safetensors"))
    dtypes = {"bf16": ml_dtypes.bfloat16, "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
    with CheckpointReader(model) as reader:
        for name, tensor in tensors.items():
            got = reader.read(name)
            assert got.dtype == np.dtype(dtypes.get(name, np.float32))
            np.testing.assert_array_equal(got.astype(np.float32), tensor.float().numpy())
        assert checkpoint_dtype(reader) == np.dtype(ml_dtypes.bfloat16)


def test_sharded_directory_with_index(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "sharded")
    shards = {
        "model-00001-of-00002.safetensors": {"embed.weight": torch.randn(6, 4).to(torch.bfloat16)},
        "model-00002-of-00002.safetensors": {
            "layers.0.w": torch.randn(4, 4).to(torch.bfloat16),
            "norm.weight": torch.ones(4, dtype=torch.float32),
        },
    }
    weight_map = {}
    for filename, tensors in shards.items():
        save_torch(tensors, str(model / filename))
        weight_map.update(dict.fromkeys(tensors, filename))
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (model / "stray.safetensors").write_bytes(b"not read: the index decides")
    with CheckpointReader(model) as reader:
        assert reader.names() == sorted(weight_map)
        for tensors in shards.values():
            for name, tensor in tensors.items():
                np.testing.assert_array_equal(reader.read(name).astype(np.float32), tensor.float().numpy())
        assert checkpoint_dtype(reader) == np.dtype(ml_dtypes.bfloat16)


def _memmap_base(array: np.ndarray) -> np.memmap | None:
    """Walks the `.base` chain to the memory map the array views, if any."""
    base = array
    while base is not None and not isinstance(base, np.memmap):
        base = base.base
    return base


def test_reads_are_zero_copy_read_only_views(numpy_model: Path) -> None:
    with CheckpointReader(numpy_model) as reader:
        first, again = reader.read("f32"), reader.read("f32")
        assert type(first) is np.ndarray and not first.flags.owndata and not first.flags.writeable
        mapping = _memmap_base(first)
        assert mapping is not None and mapping is _memmap_base(reader.read("i8"))  # one map per file
        assert np.shares_memory(first, mapping) and np.shares_memory(first, again)
        part = reader.read_slice("f32", (slice(1, 3), slice(None, None, 2)))
        np.testing.assert_array_equal(part, _numpy_tensors()["f32"][1:3, ::2])
        assert np.shares_memory(part, mapping)
    with pytest.raises(CheckpointError, match="closed"):
        reader.read("f32")
    np.testing.assert_array_equal(first, _numpy_tensors()["f32"])  # handed-out views outlive close()


def test_read_slice_rejects_bad_index(numpy_model: Path) -> None:
    with CheckpointReader(numpy_model) as reader:
        with pytest.raises(CheckpointError, match="shape"):
            reader.read_slice("f16", (slice(None), slice(None)))
        with pytest.raises(TypeError):
            reader.read_slice("f16", 0)  # type: ignore[arg-type]


def test_missing_tensor_names_it_and_suggests(numpy_model: Path) -> None:
    with CheckpointReader(numpy_model) as reader:
        with pytest.raises(CheckpointError, match=r"tensor 'f23' not found in checkpoint .*np.*close names: .*f32"):
            reader.read("f23")
        with pytest.raises(CheckpointError, match="layers.9.q_proj"):
            reader.shape("layers.9.q_proj")


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="model directory not found: .*nowhere"):
        CheckpointReader(tmp_path / "nowhere")


def test_missing_config(tmp_path: Path) -> None:
    save_numpy({"a": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="config.json not found"):
        CheckpointReader(tmp_path)


def test_pickle_only_is_refused(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "pkl")
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04 pickle that must never be opened")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*only safetensors.*never.*save_pretrained"):
        CheckpointReader(model)


def test_no_weights_at_all(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no weight files"):
        CheckpointReader(_model_dir(tmp_path / "empty"))


def test_index_naming_missing_file(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "idx")
    save_numpy({"a": np.zeros(2, np.float32)}, str(model / "model-00001-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        CheckpointReader(model)


def test_index_disagreeing_with_file(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "idx")
    save_numpy({"a": np.zeros(2, np.float32)}, str(model / "model.safetensors"))
    weight_map = {"a": "model.safetensors", "ghost": "model.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="'ghost'"):
        CheckpointReader(model)


def test_index_escaping_directory(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "idx")
    save_numpy({"a": np.zeros(2, np.float32)}, str(tmp_path / "outside.safetensors"))
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../outside.safetensors"}}))
    with pytest.raises(CheckpointError, match="outside the model directory"):
        CheckpointReader(model)


def test_duplicate_tensor_across_files(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "dup")
    save_numpy({"w": np.zeros(2, np.float32)}, str(model / "a.safetensors"))
    save_numpy({"w": np.ones(2, np.float32)}, str(model / "b.safetensors"))
    with pytest.raises(CheckpointError, match="'w' appears in both a.safetensors and b.safetensors"):
        CheckpointReader(model)


@pytest.mark.parametrize(
    ("header", "data", "header_len", "message"),
    [
        ({}, b"", 10**12, "header length .* exceeds"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, 200, "runs past the end"),
        (None, b"", None, "not valid UTF-8 JSON"),
        ([1, 2], b"", None, "expected an object"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 5, None, r"'w'.*truncated"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, r"'w'.*needs 12"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, None, r"'w'.*data_offsets"),
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, r"'w'.*shape"),
        ({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, None, r"'w'.*dtype 'C64'"),
        ({"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, None, r"'w'.*dtype \['F32'\]"),
        ({"__metadata__": [1]}, b"", None, "__metadata__"),
    ],
    ids=["huge-header", "header-past-eof", "not-json", "not-object", "truncated-data", "size-mismatch",
         "reversed-offsets", "negative-shape", "unknown-dtype", "list-dtype", "bad-metadata"],
)
def test_corrupt_files(tmp_path: Path, header: object, data: bytes, header_len: int | None, message: str) -> None:
    model = _model_dir(tmp_path / "bad")
    path = model / "model.safetensors"
    if header is None:
        path.write_bytes(struct.pack("<Q", 4) + b"\xff{[x" + data)
    else:
        _raw_safetensors(path, header, data, header_len)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=message) as info:
        CheckpointReader(model)
    assert "model.safetensors" in str(info.value)


def test_file_shorter_than_length_prefix(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "short")
    (model / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too small"):
        CheckpointReader(model)


def test_hand_written_header_with_metadata(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "hand")
    values = np.array([1.5, -2.0], dtype="<f4").tobytes() + np.array([7], dtype="<i2").tobytes()
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "I16", "shape": [1, 1], "data_offsets": [8, 10]},
    }
    _raw_safetensors(model / "model.safetensors", header, values)
    with CheckpointReader(model) as reader:
        assert reader.names() == ["a", "b"]
        np.testing.assert_array_equal(reader.read("a"), [1.5, -2.0])
        assert reader.read("b").shape == (1, 1) and reader.read("b")[0, 0] == 7


def test_checkpoint_dtype_by_bytes(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "mixed")
    tensors = {"big": np.zeros((64,), np.float16), "small": np.zeros((8,), np.float32), "ids": np.zeros(999, np.int64)}
    save_numpy(tensors, str(model / "model.safetensors"))
    with CheckpointReader(model) as reader:
        assert checkpoint_dtype(reader) == np.float16


def test_checkpoint_module_does_not_import_jax() -> None:
    code = "import sys, jengine.models.checkpoint; assert 'jax' not in sys.modules, 'jax was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


# ---- converted (orbax) checkpoints -------------------------------------------------------------------------------


def _small_params() -> dict:
    """A nested dict/tuple pytree like a converted model's."""
    import jax.numpy as jnp

    w = jnp.arange(32, dtype=jnp.float32).reshape(4, 8)
    layers = tuple({"w": w + i, "b": jnp.ones(8, jnp.bfloat16)} for i in range(2))
    return {"embed": jnp.arange(24, dtype=jnp.bfloat16).reshape(6, 4), "layers": layers, "step": jnp.int32(3)}


def _target(params: dict, sharding_for) -> dict:  # noqa: ANN001
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding_for(a)), params)


def test_converted_round_trip_on_named_sharding(tmp_path: Path) -> None:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from jengine.models.converted import converted_metadata, restore_converted, save_converted

    params = _small_params()
    assert converted_metadata(tmp_path / "conv") is None
    metadata = {"fingerprint": "abc123", "dtype": "bfloat16"}
    save_converted(tmp_path / "conv", params, metadata)
    assert converted_metadata(tmp_path / "conv") == metadata
    sharding = NamedSharding(jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1]), PartitionSpec())
    restored = restore_converted(tmp_path / "conv", _target(params, lambda a: sharding))
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(params), strict=True):
        assert got.dtype == want.dtype and got.sharding == sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    save_converted(tmp_path / "conv", params, {"fingerprint": "new"})  # re-saving replaces
    assert converted_metadata(tmp_path / "conv") == {"fingerprint": "new"}


def test_converted_errors(tmp_path: Path) -> None:
    import jax
    import jax.numpy as jnp

    from jengine.models.converted import converted_metadata, restore_converted, save_converted

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = {"w": jnp.zeros((2, 3), jnp.float32)}
    with pytest.raises(CheckpointError, match="no converted checkpoint"):
        restore_converted(tmp_path / "absent", _target(params, lambda a: sharding))
    with pytest.raises(CheckpointError, match="JSON"):
        save_converted(tmp_path / "conv", params, {"bad": object()})
    assert converted_metadata(tmp_path / "conv") is None  # a failed save leaves no commit marker
    save_converted(tmp_path / "conv", params, {})
    wrong_dtype = {"w": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16, sharding=sharding)}
    with pytest.raises(CheckpointError, match=r"\['w'\].*bfloat16"):
        restore_converted(tmp_path / "conv", wrong_dtype)
    extra = {"w": wrong_dtype["w"], "v": jax.ShapeDtypeStruct((1,), jnp.float32, sharding=sharding)}
    with pytest.raises(CheckpointError, match=r"\['v'\]: missing from checkpoint"):
        restore_converted(tmp_path / "conv", extra)
    (tmp_path / "conv" / "jengine_metadata.json").write_text(json.dumps({"format": 0, "metadata": {}}))
    assert converted_metadata(tmp_path / "conv") is None  # an old format reads as absent


_TWO_DEVICE_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jengine.models.converted import restore_converted, save_converted
    assert len(jax.devices()) == 2, jax.devices()
    mesh = jax.make_mesh((2,), ("tp",))
    w = jax.device_put(np.arange(32, dtype=np.float32).reshape(4, 8), NamedSharding(mesh, P(None, "tp")))
    save_converted(sys.argv[1], {"w": w}, {"k": 1})
    target = {"w": jax.ShapeDtypeStruct((4, 8), np.float32, sharding=NamedSharding(mesh, P("tp", None)))}
    got = restore_converted(sys.argv[1], target)["w"]
    assert got.sharding == target["w"].sharding
    assert [s.data.shape for s in got.addressable_shards] == [(2, 8), (2, 8)]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
    """
)


def test_converted_reshards_across_two_cpu_devices(tmp_path: Path) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"}
    result = subprocess.run(
        [sys.executable, "-c", _TWO_DEVICE_SCRIPT, str(tmp_path / "conv")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
