"""`load_model`: what a user sees when loading a checkpoint directory.

Refusals name what is wrong (directory, config, architecture, tensor, shape, dtype); `dtype` resolves as documented;
the placed values are the checkpoint's, on the sharding asked for; the converted-weights cache is reused only for the
same checkpoint and dtype. (Over 400 lines: these groups share module-scoped tiny checkpoints and loads, which
splitting the file would build again.)
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file
from transformers import LlamaConfig

from jengine.errors import CheckpointError, ConfigError, UnsupportedModelError
from jengine.layers.linear import split_fused
from jengine.models import loader
from jengine.models.loader import load_model, resolve_dtype
from jengine.models.registry import SUPPORTED_ARCHITECTURES
from jengine.runner.simple import SimpleGenerator
from tests.conftest import COMMON

# hidden 64, 4 query heads over 2 KV heads of width 16, 2 layers, vocabulary 128.
TINY = {**COMMON, "vocab_size": 128, "num_hidden_layers": 2}
HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]
Q_OUT = TINY["num_attention_heads"] * HEAD_DIM
KV_OUT = TINY["num_key_value_heads"] * HEAD_DIM
WEIGHTS = "model.safetensors"

COLUMN_PARALLEL = ("wqkv", "w_gate_up")  # output axis (last) split over "tp"
ROW_PARALLEL = ("wo", "w_down")  # input axis split over "tp"


@pytest.fixture(scope="module")
def llama(build_checkpoint):
    """An untied float32 Llama checkpoint (checkpoint spelling) and its HF model."""
    return build_checkpoint(LlamaConfig(**TINY), spelling="checkpoint", seed=1)


@pytest.fixture(scope="module")
def llama_tied(build_checkpoint):
    return build_checkpoint(LlamaConfig(**TINY, tie_word_embeddings=True), seed=2)


@pytest.fixture(scope="module")
def llama_bf16(build_checkpoint):
    return build_checkpoint(LlamaConfig(**TINY), dtype=torch.bfloat16, seed=3)


@pytest.fixture(scope="module")
def loaded_f32(llama):
    return load_model(llama[0], dtype="float32", progress=False)


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def _rewrite_weights(model_dir: Path, edit) -> None:
    """Re-writes the single safetensors file after `edit(tensors)` changed the dict of numpy arrays."""
    tensors = dict(load_file(model_dir / WEIGHTS))
    edit(tensors)
    save_file(tensors, model_dir / WEIGHTS, metadata={"format": "pt"})


def _hf(model, name: str) -> np.ndarray:
    return model.state_dict()[name].float().numpy()


def _leaves(params) -> dict[str, jax.Array]:
    return {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


# --- refusals ---


def test_missing_directory(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(CheckpointError, match=re.escape(str(missing))):
        load_model(missing, progress=False)


def test_directory_without_config(llama, tmp_path):
    model_dir = _copy(llama[0], tmp_path / "m")
    (model_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(model_dir, progress=False)


def test_unknown_architecture_lists_supported(llama, tmp_path):
    model_dir = _copy(llama[0], tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        load_model(model_dir, progress=False)
    assert "FalconForCausalLM" in str(info.value)
    assert len(SUPPORTED_ARCHITECTURES) >= 6
    for architecture in SUPPORTED_ARCHITECTURES:
        assert architecture in str(info.value)


def test_missing_tensor_is_named(llama, tmp_path):
    model_dir = _copy(llama[0], tmp_path / "m")
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite_weights(model_dir, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_model(model_dir, progress=False)


def test_missing_lm_head_of_untied_model_is_named(llama, tmp_path):
    model_dir = _copy(llama[0], tmp_path / "m")
    _rewrite_weights(model_dir, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=re.escape("lm_head.weight") + ".*tie_word_embeddings"):
        load_model(model_dir, progress=False)


@pytest.mark.parametrize("rename", [
    lambda name: name.removeprefix("model."),  # saved from the base model (LlamaModel)
    lambda name: "base_model.model." + name,  # a PEFT-wrapped model saved whole
])
def test_prefix_spellings_load_the_same_weights(llama, loaded_f32, tmp_path, rename):
    model_dir = _copy(llama[0], tmp_path / "m")
    _rewrite_weights(model_dir, lambda t: t.update({rename(k): t.pop(k) for k in list(t)}))
    _, params, _ = load_model(model_dir, dtype="float32", progress=False)
    ours, reference = _leaves(params), _leaves(loaded_f32[1])
    assert ours.keys() == reference.keys()
    assert all(np.array_equal(np.asarray(ours[k]), np.asarray(reference[k])) for k in ours)


def test_tied_config_with_a_different_lm_head_uses_it_as_hf_does(llama_tied, tmp_path):
    """transformers 5 unties a checkpoint whose lm_head.weight differs from the embedding (with a warning); the
    logits follow HF's, and an identical copy keeps the tie."""
    model_dir = _copy(llama_tied[0], tmp_path / "m")
    head = np.random.default_rng(0).standard_normal((TINY["vocab_size"], TINY["hidden_size"])).astype(np.float32)
    _rewrite_weights(model_dir, lambda t: t.update({"lm_head.weight": head}))
    spec, params, _ = load_model(model_dir, dtype="float32", progress=False)
    assert not spec.tie_word_embeddings and np.array_equal(np.asarray(params["lm_head"]), head)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = [[5, 17, 33, 2, 90, 7]]
    ours = SimpleGenerator(spec, params, jnp.float32, block_size=4).generate(prompt, 1, return_prompt_logits=True)
    with torch.no_grad():
        reference = hf(torch.tensor(prompt)).logits[0].numpy()
    np.testing.assert_allclose(ours.prompt_logits[0], reference, atol=1e-4 * np.abs(reference).max())
    same = _copy(llama_tied[0], tmp_path / "same")
    _rewrite_weights(same, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    spec_same, params_same, _ = load_model(same, dtype="float32", progress=False)
    assert spec_same.tie_word_embeddings and "lm_head" not in params_same


def test_misshaped_tensor_names_tensor_and_both_shapes(llama, tmp_path):
    model_dir = _copy(llama[0], tmp_path / "m")
    name = "model.layers.0.self_attn.k_proj.weight"  # HF [out, in] = (KV_OUT, hidden)
    bad_shape = (KV_OUT, TINY["hidden_size"] - 8)

    def edit(tensors):
        tensors[name] = tensors[name][:, : bad_shape[1]].copy()

    _rewrite_weights(model_dir, edit)
    with pytest.raises(CheckpointError) as info:
        load_model(model_dir, progress=False)
    message = str(info.value)
    assert name in message
    assert str(bad_shape) in message  # (32, 56): what the file holds
    assert str((KV_OUT, TINY["hidden_size"])) in message  # (32, 64): what config.json implies


def test_integer_weight_is_refused(llama, tmp_path):
    model_dir = _copy(llama[0], tmp_path / "m")
    name = "model.layers.0.input_layernorm.weight"

    def edit(tensors):
        tensors[name] = np.ones(tensors[name].shape, dtype=np.int32)

    _rewrite_weights(model_dir, edit)
    with pytest.raises(CheckpointError, match="dtype") as info:
        load_model(model_dir, progress=False)
    assert name in str(info.value)
    assert "int32" in str(info.value)


@pytest.mark.parametrize("dtype", ["float64", "int8", "fp8", "bfloat"])
def test_unsupported_requested_dtype(llama, dtype):
    with pytest.raises(ConfigError, match=dtype):
        load_model(llama[0], dtype=dtype, progress=False)


# --- dtype resolution ---


@pytest.mark.parametrize(
    "checkpoint, expected",
    [
        ("bfloat16", jnp.bfloat16),
        ("float16", jnp.float16),
        ("float32", jnp.float32),
        (np.dtype("<f4"), jnp.float32),
        (np.dtype("<f2"), jnp.float16),
        (np.dtype(ml_dtypes.bfloat16), jnp.bfloat16),
    ],
)
def test_auto_keeps_the_checkpoint_dtype_on_cpu(checkpoint, expected):
    assert resolve_dtype("auto", checkpoint, "cpu") == jnp.dtype(expected)


@pytest.mark.parametrize(
    "checkpoint, expected",
    [("float32", jnp.bfloat16), (np.dtype("<f4"), jnp.bfloat16), ("bfloat16", jnp.bfloat16), ("float16", jnp.float16)],
)
def test_auto_runs_float32_checkpoints_in_bfloat16_on_gpu(checkpoint, expected):
    assert resolve_dtype("auto", checkpoint, "gpu") == jnp.dtype(expected)


@pytest.mark.parametrize(
    "requested, expected",
    [
        ("bfloat16", jnp.bfloat16), ("bf16", jnp.bfloat16),
        ("float16", jnp.float16), ("fp16", jnp.float16), ("half", jnp.float16),
        ("float32", jnp.float32), ("fp32", jnp.float32), ("float", jnp.float32),
    ],
)
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_explicit_dtype_names_and_aliases(requested, expected, platform):
    """An explicit choice wins over the checkpoint's dtype and over the GPU rule."""
    for checkpoint in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(requested, checkpoint, platform) == jnp.dtype(expected)


@pytest.mark.parametrize("requested", ["float64", "int8", "auto16", "BF16"])
def test_resolve_dtype_refuses_other_names(requested):
    with pytest.raises(ConfigError, match="unsupported dtype"):
        resolve_dtype(requested, "float32", "cpu")


def test_auto_on_cpu_loads_float32_checkpoint_in_float32(llama):
    spec, params, dtype = load_model(llama[0], progress=False)
    assert dtype == jnp.float32
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}


def test_auto_loads_bfloat16_checkpoint_in_bfloat16(llama_bf16):
    spec, params, dtype = load_model(llama_bf16[0], progress=False)
    assert dtype == jnp.bfloat16
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}


def test_auto_without_dtype_in_config_uses_the_tensors_dtype(llama_bf16, tmp_path):
    model_dir = _copy(llama_bf16[0], tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (model_dir / "config.json").write_text(json.dumps(config))
    spec, params, dtype = load_model(model_dir, progress=False)
    assert spec.checkpoint_dtype is None
    assert dtype == jnp.bfloat16
    assert params["embed"].dtype == jnp.bfloat16


# --- values ---


@pytest.mark.parametrize("layer", [0, 1])
def test_loaded_values_equal_the_checkpoint(llama, loaded_f32, layer):
    _, hf = llama
    spec, params, dtype = loaded_f32
    assert len(params["layers"]) == spec.num_layers == 2
    seg = params["layers"][layer]
    attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
    # Projections are stored [in, out]: the transpose of HF's [out, in]; q|k|v and gate|up side by side.
    assert seg["wqkv"].shape == (TINY["hidden_size"], Q_OUT + 2 * KV_OUT)
    qkv = [_hf(hf, f"{attn}.{name}_proj.weight").T for name in "qkv"]
    np.testing.assert_array_equal(np.asarray(seg["wqkv"]), np.concatenate(qkv, axis=1))
    np.testing.assert_array_equal(np.asarray(seg["wo"]), _hf(hf, f"{attn}.o_proj.weight").T)
    gate_up = [_hf(hf, f"{mlp}.{name}_proj.weight").T for name in ("gate", "up")]
    np.testing.assert_array_equal(np.asarray(seg["w_gate_up"]), np.concatenate(gate_up, axis=1))
    np.testing.assert_array_equal(np.asarray(seg["w_down"]), _hf(hf, f"{mlp}.down_proj.weight").T)
    np.testing.assert_array_equal(
        np.asarray(seg["attn_norm"]), _hf(hf, f"model.layers.{layer}.input_layernorm.weight")
    )
    np.testing.assert_array_equal(
        np.asarray(seg["mlp_norm"]), _hf(hf, f"model.layers.{layer}.post_attention_layernorm.weight")
    )


def test_fused_columns_are_grouped_per_tensor_parallel_shard(llama):
    """With 2 shards, each half of a fused projection holds that half of q, then of k, then of v (gate, up): a
    contiguous split over 2 devices gives each its own heads' slices."""
    _, hf = llama
    spec, params, _ = load_model(llama[0], dtype="float32", progress=False, projection_shards=2)
    assert spec.projection_shards == 2
    attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
    q, k, v = (_hf(hf, f"{attn}.{name}_proj.weight").T for name in "qkv")
    gate, up = (_hf(hf, f"{mlp}.{name}_proj.weight").T for name in ("gate", "up"))
    qh, kh, ih = Q_OUT // 2, KV_OUT // 2, TINY["intermediate_size"] // 2
    want_qkv = np.concatenate([q[:, :qh], k[:, :kh], v[:, :kh], q[:, qh:], k[:, kh:], v[:, kh:]], axis=1)
    want_gate_up = np.concatenate([gate[:, :ih], up[:, :ih], gate[:, ih:], up[:, ih:]], axis=1)
    np.testing.assert_array_equal(np.asarray(params["layers"][1]["wqkv"]), want_qkv)
    np.testing.assert_array_equal(np.asarray(params["layers"][1]["w_gate_up"]), want_gate_up)


def test_split_fused_recovers_the_parts():
    rng = np.random.default_rng()
    parts = [rng.standard_normal((3, w)).astype(np.float32) for w in (8, 4, 4)]
    shards = 2
    fused = np.concatenate([p[:, s * p.shape[1] // shards:(s + 1) * p.shape[1] // shards]
                            for s in range(shards) for p in parts], axis=1)
    for got, want in zip(split_fused(jnp.asarray(fused), (8, 4, 4), shards), parts, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_embed_norm_and_lm_head_equal_the_checkpoint(llama, loaded_f32):
    _, hf = llama
    _, params, _ = loaded_f32
    np.testing.assert_array_equal(np.asarray(params["embed"]), _hf(hf, "model.embed_tokens.weight"))
    np.testing.assert_array_equal(np.asarray(params["final_norm"]), _hf(hf, "model.norm.weight"))
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), _hf(hf, "lm_head.weight"))
    assert not np.array_equal(np.asarray(params["lm_head"]), np.asarray(params["embed"]))


def test_tied_model_has_no_lm_head(llama_tied):
    model_dir, hf = llama_tied
    spec, params, _ = load_model(model_dir, dtype="float32", progress=False)
    assert spec.tie_word_embeddings
    assert "lm_head" not in params
    np.testing.assert_array_equal(np.asarray(params["embed"]), _hf(hf, "model.embed_tokens.weight"))


def test_bfloat16_request_casts_every_weight(llama, loaded_f32):
    _, ref, _ = loaded_f32
    spec, params, dtype = load_model(llama[0], dtype="bf16", progress=False)
    assert dtype == jnp.bfloat16
    ours, theirs = _leaves(params), _leaves(ref)
    assert ours.keys() == theirs.keys()
    for path, leaf in ours.items():
        assert leaf.dtype == jnp.bfloat16, path
        expected = np.asarray(theirs[path]).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(np.asarray(leaf), expected, err_msg=path)


# --- placement ---


def _tp_sharding(mesh):
    """Megatron-style tensor parallelism over axis "tp"; everything else replicated."""

    def sharding_for(path: str, shape: tuple[int, ...]):
        name = re.findall(r"\['(\w+)'\]", path)[-1]
        if name in COLUMN_PARALLEL:
            return NamedSharding(mesh, P(None, "tp"))
        if name in ROW_PARALLEL:
            return NamedSharding(mesh, P("tp", None))
        return NamedSharding(mesh, P())

    return sharding_for


def _tp_mesh(n: int):
    return jax.make_mesh((n,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])


PROMPTS = [[5, 17, 99, 3, 42, 8, 120], [64, 1, 77], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module")
def unsharded_tokens(llama, loaded_f32):
    spec, params, dtype = loaded_f32
    return SimpleGenerator(spec, params, dtype, block_size=4).generate(PROMPTS, 8).token_ids


@pytest.mark.parametrize("devices", [2, 4])
def test_placement_on_a_tensor_parallel_sharding(llama, loaded_f32, unsharded_tokens, devices):
    mesh = _tp_mesh(devices)
    sharding_for = _tp_sharding(mesh)
    spec, params, dtype = load_model(llama[0], dtype="float32", sharding=sharding_for, progress=False)
    reference = _leaves(loaded_f32[1])
    placed = _leaves(params)
    assert placed.keys() == reference.keys()
    for path, arr in placed.items():
        name = re.findall(r"\['(\w+)'\]", path)[-1]
        assert arr.sharding == sharding_for(path, arr.shape), path
        assert arr.shape == reference[path].shape
        expected_shard_shape = list(arr.shape)
        if name in COLUMN_PARALLEL:
            expected_shard_shape[1] //= devices
        elif name in ROW_PARALLEL:
            expected_shard_shape[0] //= devices
        full = np.asarray(reference[path])
        shards = arr.addressable_shards
        assert {s.device for s in shards} == set(mesh.devices.flat)
        for shard in shards:
            assert shard.data.shape == tuple(expected_shard_shape), path
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index], err_msg=path)
        if name in COLUMN_PARALLEL + ROW_PARALLEL:  # really split: the shards hold different slices
            assert len({tuple(np.asarray(s.data).ravel()[:4]) for s in shards}) == devices, path

    tokens = SimpleGenerator(spec, params, dtype, block_size=4).generate(PROMPTS, 8).token_ids
    assert tokens == unsharded_tokens


def test_placement_on_one_sharding_for_everything(llama, loaded_f32):
    """A plain `Sharding` (not a function) is used for every parameter."""
    sharding = NamedSharding(_tp_mesh(2), P())
    _, params, _ = load_model(llama[0], dtype="float32", sharding=sharding, progress=False)
    for path, arr in _leaves(params).items():
        assert arr.sharding == sharding, path
    np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(loaded_f32[1]["embed"]))


# --- converted-weights cache ---


@pytest.fixture
def count_conversions(monkeypatch):
    calls = []
    original = loader._place_all

    def counting(*args, **kwargs):
        calls.append(args[2])  # the dtype converted to
        return original(*args, **kwargs)

    monkeypatch.setattr(loader, "_place_all", counting)
    return calls


def _assert_same(a, b) -> None:
    la, lb = _leaves(a), _leaves(b)
    assert la.keys() == lb.keys()
    for path in la:
        assert la[path].dtype == lb[path].dtype, path
        np.testing.assert_array_equal(np.asarray(la[path]), np.asarray(lb[path]), err_msg=path)


def test_converted_weights_are_restored_for_the_same_checkpoint_and_dtype(llama, tmp_path, count_conversions, caplog):
    cache = tmp_path / "converted"
    spec1, first, dtype1 = load_model(llama[0], dtype="float32", progress=False, converted_dir=cache)
    assert count_conversions == [jnp.dtype(jnp.float32)]

    with caplog.at_level(logging.INFO, logger="jengine.models.loader"):
        spec2, second, dtype2 = load_model(llama[0], dtype="float32", progress=False, converted_dir=cache)
    assert count_conversions == [jnp.dtype(jnp.float32)], "the second load converted again"
    assert "restoring converted weights" in caplog.text
    assert (spec2, dtype2) == (spec1, dtype1)
    _assert_same(first, second)

    # Another dtype is a different conversion: converted afresh, then itself reused.
    _, third, dtype3 = load_model(llama[0], dtype="bfloat16", progress=False, converted_dir=cache)
    assert dtype3 == jnp.bfloat16
    assert count_conversions == [jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)]
    assert {leaf.dtype for leaf in jax.tree.leaves(third)} == {jnp.dtype(jnp.bfloat16)}
    _, fourth, _ = load_model(llama[0], dtype="bfloat16", progress=False, converted_dir=cache)
    assert len(count_conversions) == 2
    _assert_same(third, fourth)


def test_restored_weights_go_to_the_requested_sharding(llama, tmp_path, monkeypatch):
    cache = tmp_path / "converted"
    _, unsharded, _ = load_model(llama[0], dtype="float32", progress=False, converted_dir=cache)

    def no_conversion(*args, **kwargs):
        raise AssertionError("expected the converted weights to be restored")

    monkeypatch.setattr(loader, "_place_all", no_conversion)
    sharding_for = _tp_sharding(_tp_mesh(2))
    _, params, _ = load_model(llama[0], dtype="float32", sharding=sharding_for, progress=False, converted_dir=cache)
    for path, arr in _leaves(params).items():
        assert arr.sharding == sharding_for(path, arr.shape), path
    _assert_same(params, unsharded)


def test_converted_weights_are_not_reused_after_the_checkpoint_changes(llama, tmp_path, count_conversions):
    """Re-saving the checkpoint with new weights of the same shapes (e.g. after fine-tuning) invalidates the cache."""
    model_dir = _copy(llama[0], tmp_path / "m")
    cache = tmp_path / "converted"
    _, before, _ = load_model(model_dir, dtype="float32", progress=False, converted_dir=cache)

    def edit(tensors):
        tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1.0

    _rewrite_weights(model_dir, edit)
    _, after, _ = load_model(model_dir, dtype="float32", progress=False, converted_dir=cache)
    assert len(count_conversions) == 2
    np.testing.assert_array_equal(np.asarray(after["final_norm"]), np.asarray(before["final_norm"]) + 1.0)


# --- projections transposed on the device (the accelerator default) ---


@pytest.fixture(scope="module")
def qwen3_moe(build_checkpoint):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 2}, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2, mlp_only_layers=[0])
    return build_checkpoint(config, seed=4)


@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize(("model", "dtype"), [("llama", "float32"), ("llama_bf16", "float32"),
                                              ("llama_bf16", "bfloat16"), ("qwen3_moe", "float32")])
def test_transposing_on_the_device_places_what_the_host_path_places(request, model, dtype, devices):
    """Bit for bit and in the same shardings: column- and row-parallel splits, fused q/k/v and gate/up grouped per
    shard, experts stacked, a cast from the checkpoint's dtype."""
    model_dir = request.getfixturevalue(model)[0]
    sharding_for = _tp_sharding(_tp_mesh(devices))
    kwargs = dict(dtype=dtype, sharding=sharding_for, projection_shards=devices, progress=False)
    _, on_host, _ = load_model(model_dir, transpose_on_device=False, **kwargs)
    _, on_device, _ = load_model(model_dir, transpose_on_device=True, **kwargs)
    host, device = _leaves(on_host), _leaves(on_device)
    assert host.keys() == device.keys()
    for path, expected in host.items():
        assert device[path].sharding == expected.sharding, path
        assert device[path].dtype == expected.dtype, path
        np.testing.assert_array_equal(np.asarray(device[path]), np.asarray(expected), err_msg=path)
