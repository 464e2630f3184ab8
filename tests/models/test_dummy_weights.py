"""`load_format="dummy"`: an engine from config.json and a tokenizer alone, random weights made on the devices.

Model directories here hold no weight file, so any checkpoint read would fail. The random parameters are checked
against what the safetensors loader places for a real checkpoint of the same config and layout: the same pytree,
shapes, dtypes and shardings (8 simulated CPU devices, tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import (LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                          Qwen3MoeConfig)

from jengine import LLM, SamplingParams
from jengine.cli import build_parser, engine_kwargs
from jengine.config import EngineConfig
from jengine.errors import CheckpointError, ConfigError
from jengine.layers.quant import QuantizedWeight, dequantize
from jengine.layers.quant4 import Int4Experts, Int4Weight, dequantize4
from jengine.models.dummy import WEIGHT_STD, dummy_model
from jengine.models.loader import load_model, load_spec
from jengine.models.registry import SUPPORTED_ARCHITECTURES
from jengine.parallel.mesh import build_mesh, replica_devices
from jengine.parallel.sharding import plan_layout
from tests.conftest import COMMON

CONFIGS = {
    "LlamaForCausalLM": lambda: LlamaConfig(**COMMON),
    "MistralForCausalLM": lambda: MistralConfig(**COMMON, sliding_window=32),
    "Qwen2ForCausalLM": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "Qwen3ForCausalLM": lambda: Qwen3Config(**COMMON, head_dim=32),
    "MixtralForCausalLM": lambda: MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2),
    "Qwen3MoeForCausalLM": lambda: Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 4}, moe_intermediate_size=32,
                                                  num_experts=8, num_experts_per_tok=3, mlp_only_layers=[0]),
    "Qwen2MoeForCausalLM": lambda: Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=8,
                                                  num_experts_per_tok=3, shared_expert_intermediate_size=48),
}


def config_only_dir(config, root: Path, tokenizer_dir: Path | None) -> Path:
    """config.json (and the tokenizer's files when given), no weights."""
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(root)
    for item in (Path(tokenizer_dir).iterdir() if tokenizer_dir else ()):
        shutil.copy(item, root / item.name)
    assert not list(root.glob("*.safetensors"))
    return root


def test_every_family_has_a_case():
    assert set(CONFIGS) == set(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_dummy_model_generates_without_a_checkpoint(architecture, tmp_path, tiny_tokenizer_dir):
    model_dir = config_only_dir(CONFIGS[architecture](), tmp_path, tiny_tokenizer_dir)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    with LLM(str(model_dir), load_format="dummy", max_model_len=64) as llm:
        out = llm.generate(["Hello, world!", "Zürich 你好"], params, use_tqdm=False)
        core = llm._core
        assert not core.has_unfinished() and core.kv_manager.num_free_blocks == core.kv_manager.num_blocks
    for request in out:
        choice = request.outputs[0]
        assert len(choice.token_ids) == 6
        assert all(np.isfinite(lp[t].logprob) for lp, t in zip(choice.logprobs, choice.token_ids))


def test_deep_bfloat16_stack_stays_finite(tmp_path, tiny_tokenizer_dir):
    """48 MoE layers in bfloat16: the residual stream neither overflows nor collapses to one token."""
    config = Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 48}, moe_intermediate_size=32, num_experts=8,
                            num_experts_per_tok=2, dtype="bfloat16")
    model_dir = config_only_dir(config, tmp_path, tiny_tokenizer_dir)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    with LLM(str(model_dir), load_format="dummy", max_model_len=64) as llm:
        choice = llm.generate([list(range(3, 40))], params, use_tqdm=False)[0].outputs[0]
        assert llm._core.runner.params["embed"].dtype == jnp.bfloat16
    logprobs = [lp[t].logprob for lp, t in zip(choice.logprobs, choice.token_ids)]
    assert all(np.isfinite(logprobs)) and min(logprobs) > -1e3


@pytest.mark.parametrize("architecture, tp, ep", [("Qwen3MoeForCausalLM", 4, True), ("MixtralForCausalLM", 2, False),
                                                  ("Qwen2ForCausalLM", 4, False)])
def test_leaves_are_placed_as_the_loader_places_a_checkpoint(architecture, tp, ep, build_checkpoint, tmp_path):
    hf_dir, _ = build_checkpoint(CONFIGS[architecture]())
    layout = plan_layout(load_spec(hf_dir), build_mesh(replica_devices(tp)), ep)
    placement = dict(dtype="bfloat16", sharding=layout.param_sharding, kv_head_repeat=layout.kv_head_repeat,
                     projection_shards=layout.size, progress=False)
    spec, loaded, dtype = load_model(hf_dir, **placement)
    dummy_spec, params, dummy_dtype = dummy_model(config_only_dir(CONFIGS[architecture](), tmp_path, None),
                                                  **placement)
    # a config.json alone states no dtype where the checkpoint's does
    assert dataclasses.replace(dummy_spec, checkpoint_dtype="float32") == spec
    assert dummy_dtype == dtype == jnp.bfloat16
    assert jax.tree.structure(params) == jax.tree.structure(loaded)
    for (path, leaf), want in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(loaded)):
        name = jax.tree_util.keystr(path)
        assert (leaf.shape, leaf.dtype) == (want.shape, want.dtype), name
        assert leaf.sharding.is_equivalent_to(want.sharding, leaf.ndim), name
        assert leaf.addressable_shards[0].data.shape == want.addressable_shards[0].data.shape, name


def test_values_are_at_a_sane_scale(tmp_path):
    model_dir = config_only_dir(CONFIGS["MixtralForCausalLM"](), tmp_path, None)
    _, params, _ = dummy_model(model_dir, dtype="float32", progress=False, seed=3)
    layer0, layer1 = params["layers"][0], params["layers"][1]
    for norm in (params["final_norm"], layer0["attn_norm"], layer1["mlp_norm"]):
        np.testing.assert_array_equal(np.asarray(norm), 1.0)
    for weight in (params["embed"], layer0["wqkv"], layer0["we_gate"], layer1["we_down"], layer1["router"]):
        values = np.asarray(weight)
        assert abs(values.std() / WEIGHT_STD - 1) < 0.1 and abs(values.mean()) < 0.01
    assert not np.array_equal(np.asarray(layer0["wo"]), np.asarray(layer1["wo"]))
    again = dummy_model(model_dir, dtype="float32", progress=False, seed=3)[1]
    np.testing.assert_array_equal(np.asarray(again["layers"][1]["we_up"]), np.asarray(layer1["we_up"]))


def test_a_missing_tokenizer_says_how_to_give_one(tmp_path, tiny_tokenizer_dir):
    model_dir = config_only_dir(CONFIGS["LlamaForCausalLM"](), tmp_path, None)
    with pytest.raises(CheckpointError, match=r"load_format='dummy'.*tokenizer=DIR \(--tokenizer DIR\)"):
        LLM(str(model_dir), load_format="dummy")
    with LLM(str(model_dir), load_format="dummy", tokenizer=str(tiny_tokenizer_dir), max_model_len=32) as llm:
        assert llm.generate(["Hi"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0].outputs[0].text


def test_load_format_values():
    assert EngineConfig.from_kwargs("m").model.load_format == "auto"
    for value in ("auto", "safetensors", "dummy", None):
        EngineConfig.from_kwargs("m", load_format=value)
    for value in ("pt", "npcache", "gguf", "bitsandbytes", "tensorizer"):
        with pytest.raises(ConfigError, match=f"load_format={value!r} is not supported: choose auto, safetensors, "
                                              "dummy"):
            EngineConfig.from_kwargs("m", load_format=value)
    for command in (["generate"], ["serve", "m"], ["bench", "throughput"]):
        args = build_parser().parse_args([*command, "--load-format", "dummy"])
        assert engine_kwargs(args)["load_format"] == "dummy"


def _quantized_pair(build_checkpoint, tmp_path, config, quantize) -> tuple[Path, Path]:
    """(a real checkpoint of `config` quantized by `quantize(model_dir)`, a directory with its config.json alone)."""
    hf_dir, _ = build_checkpoint(config)
    quantize(hf_dir)
    bare = tmp_path / "config-only"
    bare.mkdir()
    shutil.copy(hf_dir / "config.json", bare / "config.json")
    return hf_dir, bare


def _awq(group: int):
    from tests.models.quant4_packing import quantize_checkpoint
    return lambda model_dir: quantize_checkpoint(model_dir, "awq", group=group)


def _gptq8(model_dir: Path) -> None:
    from tests.models.quant4_packing import quantize_checkpoint
    quantize_checkpoint(model_dir, "gptq", group=32, bits=8, symmetric=True)


def _fp8_blocks(tmp_path):
    from tests.models import quant_checkpoints as qc

    def quantize(model_dir: Path) -> None:
        fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
        quantized, _ = qc.write_quantized(model_dir, tmp_path / "fp8", fp8, qc.fp8_block(16, 16))
        for item in quantized.iterdir():  # the quantized checkpoint in place of the float one
            shutil.copy(item, model_dir / item.name)
    return quantize


MOE_QUANT = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
QUANTIZED_CASES = {
    # experts packed in groups of 32; attention in groups of 32 read as float (the W4A16 kernel takes 128s)
    "awq-moe-tp2": (lambda: Qwen3MoeConfig(**COMMON, **MOE_QUANT), lambda tmp: _awq(32), 2, False),
    "awq-moe-ep2": (lambda: Qwen3MoeConfig(**COMMON, **MOE_QUANT), lambda tmp: _awq(32), 2, True),
    # every dense projection packed in groups of 128
    "awq-dense": (lambda: LlamaConfig(**{**COMMON, "hidden_size": 128, "intermediate_size": 256}),
                  lambda tmp: _awq(128), 1, False),
    "fp8-block-moe-tp2": (lambda: Qwen3MoeConfig(**COMMON, **MOE_QUANT), _fp8_blocks, 2, False),
    "gptq8-moe-tp2": (lambda: Qwen3MoeConfig(**COMMON, **MOE_QUANT), lambda tmp: _gptq8, 2, False),
    # Qwen2-MoE: the shared expert's down (128 input rows) packed as a dense projection, split by rows
    "awq-shared-expert-tp2": (lambda: Qwen2MoeConfig(**COMMON, **MOE_QUANT, shared_expert_intermediate_size=256),
                              lambda tmp: _awq(128), 2, False),
}


@pytest.mark.parametrize("case", QUANTIZED_CASES)
def test_quantized_leaves_are_placed_as_the_loader_places_a_checkpoint(case, build_checkpoint, tmp_path):
    """A quantized config.json alone gives the quantized leaves its checkpoint gives: 4-bit projections and expert
    stacks packed where the kernels take them (float where the loader dequantizes), 8-bit ones in their scheme;
    the same pytree (static fields included), shapes, dtypes and shardings."""
    make_config, quantize, tp, ep = QUANTIZED_CASES[case]
    hf_dir, bare = _quantized_pair(build_checkpoint, tmp_path, make_config(), quantize(tmp_path))
    layout = plan_layout(load_spec(hf_dir), build_mesh(replica_devices(tp)), ep)
    placement = dict(dtype="float32", sharding=layout.param_sharding, kv_head_repeat=layout.kv_head_repeat,
                     projection_shards=layout.size, progress=False)
    _, loaded, _ = load_model(hf_dir, **placement)
    _, params, _ = dummy_model(bare, **placement)
    assert jax.tree.structure(params) == jax.tree.structure(loaded)
    quantized = (Int4Weight, Int4Experts, QuantizedWeight)
    kinds = {type(leaf) for leaf in jax.tree.leaves(params["layers"][0], is_leaf=lambda x: isinstance(x, quantized))}
    assert kinds & set(quantized)
    for (path, leaf), want in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(loaded)):
        name = jax.tree_util.keystr(path)
        assert (leaf.shape, leaf.dtype) == (want.shape, want.dtype), name
        assert leaf.sharding.is_equivalent_to(want.sharding, leaf.ndim), name


def test_quantized_dummy_weights_have_the_float_dummies_scale(build_checkpoint, tmp_path):
    _, bare = _quantized_pair(build_checkpoint, tmp_path, Qwen3MoeConfig(**COMMON, **MOE_QUANT), _awq(32))
    _, params, _ = dummy_model(bare, dtype="float32", progress=False)
    for stack in (params["layers"][0]["we_gate"], params["layers"][2]["we_down"]):
        assert isinstance(stack, Int4Experts)
        values = np.asarray(dequantize4(stack))
        assert abs(values.std() / WEIGHT_STD - 1) < 0.1 and abs(values.mean()) < 0.1 * WEIGHT_STD
    fp8 = dummy_model(config_only_dir(CONFIGS["LlamaForCausalLM"](), tmp_path / "f", None), dtype="float32",
                      progress=False, quantization="fp8")[1]["layers"][0]["wqkv"]
    assert isinstance(fp8, QuantizedWeight) and fp8.weight.dtype == jnp.float8_e4m3fn
    assert abs(np.asarray(dequantize(fp8)).std() / WEIGHT_STD - 1) < 0.1


def test_a_quantized_dummy_model_generates(build_checkpoint, tmp_path, tiny_tokenizer_dir):
    _, bare = _quantized_pair(build_checkpoint, tmp_path, Qwen3MoeConfig(**COMMON, **MOE_QUANT), _awq(32))
    for item in Path(tiny_tokenizer_dir).iterdir():
        shutil.copy(item, bare / item.name)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    with LLM(str(bare), load_format="dummy", max_model_len=64) as llm:
        choice = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
        assert isinstance(llm._core.runner.params["layers"][0]["we_up"], Int4Experts)
    assert len(choice.token_ids) == 4
    assert all(np.isfinite(lp[t].logprob) for lp, t in zip(choice.logprobs, choice.token_ids))
