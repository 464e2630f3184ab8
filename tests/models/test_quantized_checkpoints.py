"""8-bit checkpoints: each on-disk format gives the logits of the same model with the dequantized weights.

Tolerances (float32 models, `max|ours − ref| ≤ tol · max|ref|` over every prompt position): the CPU reference
(dequantize, then matmul) 1e-4, like the float parity tests; the device math on the CPU (activations quantized in the
step) 1.5e-1 with float8 activations (3 mantissa bits), 5e-2 with int8 activations, 1e-4 weight-only. The packing of
the test writers is checked against the compressed-tensors library's own compress/decompress.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, Qwen3MoeConfig

from jengine.errors import UnsupportedModelError
from jengine.layers.quant import QuantizedWeight
from jengine.models.loader import load_model
from jengine.runner.simple import SimpleGenerator
from tests.conftest import COMMON
from tests.models import quant_checkpoints as qc

PROMPTS = [[5, 9, 33, 70, 2, 11, 40], [7, 100, 3]]
REFERENCE_TOL = 1e-4
DEVICE_TOL = {"fp8": 1.5e-1, "int8": 5e-2, None: 1e-4}

FORMATS = {
    "fp8-tensor-dynamic": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, qc.fp8_tensor()),
    "fp8-tensor-static": ({"quant_method": "fp8", "activation_scheme": "static"}, qc.fp8_tensor(input_scale=0.02)),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [32, 32]}, qc.fp8_block(32, 32)),
    "ct-float-channel-token": (qc.ct_config("float-quantized", {"type": "float", "strategy": "channel"},
                                            {"type": "float", "strategy": "token", "dynamic": True}),
                               qc.channel("float", torch.bfloat16)),
    "ct-float-tensor-static": (qc.ct_config("float-quantized", {"type": "float", "strategy": "tensor"},
                                            {"type": "float", "strategy": "tensor", "dynamic": False}),
                               qc.fp8_tensor(input_scale=0.02)),
    "ct-float-block": (qc.ct_config("float-quantized", {"type": "float", "strategy": "block",
                                                        "block_structure": [32, 32]},
                                    {"type": "float", "strategy": "group", "group_size": 32, "dynamic": True}),
                       qc.fp8_block(32, 32, scale_name="weight_scale")),
    "ct-int-channel-token": (qc.ct_config("int-quantized", {"type": "int", "strategy": "channel"},
                                          {"type": "int", "strategy": "token", "dynamic": True}), qc.channel("int")),
    "ct-naive-int-w8a16": (qc.ct_config("naive-quantized", {"type": "int", "strategy": "channel"}, None),
                           qc.channel("int")),
    "ct-pack8-channel": (qc.ct_config("pack-quantized", {"type": "int", "strategy": "channel"}, None),
                         qc.packed(qc.channel("int"))),
    "ct-pack8-group32": (qc.ct_config("pack-quantized", {"type": "int", "strategy": "group", "group_size": 32},
                                      None), qc.packed(qc.int_group(32))),
    # NVIDIA Model Optimizer: its hf_quant_config.json's nesting, and config.json's flat spelling
    "modelopt-fp8": ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                                                                   "exclude_modules": ["lm_head"]}},
                     qc.fp8_tensor(input_scale=0.02)),
    "modelopt-fp8-channel-token": ({"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN",
                                    "ignore": ["lm_head"]},
                                   qc.reshaped_scale(qc.channel("float"), lambda shape: shape[:1])),
    "modelopt-fp8-blocks": ({"quant_method": "modelopt", "quant_algo": "fp8_pb_wo"},
                            qc.reshaped_scale(qc.fp8_block(128, 128, scale_name="weight_scale"),
                                              lambda shape: (shape[0], 1, shape[1], 1))),
}


@pytest.fixture(scope="module")
def llama(build_checkpoint):
    return build_checkpoint(LlamaConfig(**{**COMMON, "num_hidden_layers": 2}), seed=4)[0]


def prompt_logits(model_dir, impl: str | None = None, **kwargs) -> np.ndarray:
    spec, params, dtype = load_model(model_dir, dtype="float32", progress=False, **kwargs)
    if impl is not None:
        params = jax.tree.map(lambda leaf: _with_impl(leaf, impl), params,
                              is_leaf=lambda x: isinstance(x, QuantizedWeight))
    result = SimpleGenerator(spec, params, dtype, block_size=4).generate(PROMPTS, 1, return_prompt_logits=True)
    return np.concatenate(result.prompt_logits)


def _with_impl(leaf, impl: str):
    if not isinstance(leaf, QuantizedWeight):
        return leaf
    import dataclasses
    return dataclasses.replace(leaf, scheme=dataclasses.replace(leaf.scheme, impl=impl))


def _relative(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_gives_the_dequantized_models_logits(llama, tmp_path, name):
    config, quantize = FORMATS[name]
    quantized, dequantized = qc.write_quantized(llama, tmp_path, config, quantize)
    ref = prompt_logits(dequantized)
    _, params, _ = load_model(quantized, dtype="float32", progress=False)
    layer = params["layers"][0]
    assert all(isinstance(layer[k], QuantizedWeight) for k in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert layer["wqkv"].weight.dtype.itemsize == 1 and not isinstance(params["lm_head"], QuantizedWeight)
    assert _relative(prompt_logits(quantized), ref) <= REFERENCE_TOL
    acts = layer["wqkv"].scheme.activations
    device = _relative(prompt_logits(quantized, impl="xla"), ref)
    print(f"{name}: device math vs dequantized float32, max rel. logit error {device:.2e}")
    assert device <= DEVICE_TOL[acts]


def test_fp8_at_load_quantizes_a_float_checkpoint_per_channel(llama, tmp_path):
    """`quantization="fp8"` on a float checkpoint: what the float8 per-channel checkpoint of it would give."""
    _, dequantized = qc.write_quantized(llama, tmp_path, {}, qc.channel("float"))
    ref = prompt_logits(dequantized)
    assert _relative(prompt_logits(llama, quantization="fp8"), ref) <= REFERENCE_TOL
    assert _relative(prompt_logits(llama, impl="xla", quantization="fp8"), ref) <= DEVICE_TOL["fp8"]
    float_logits = prompt_logits(llama)
    agreement = np.mean(prompt_logits(llama, impl="xla", quantization="fp8").argmax(-1) == float_logits.argmax(-1))
    print(f"fp8 at load: greedy agreement with the float model {agreement:.2f}")
    assert agreement >= 0.7


def test_moe_experts_in_fp8_blocks_run_through_the_expert_path(build_checkpoint, tmp_path):
    config = Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 2}, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2, norm_topk_prob=True)
    src, _ = build_checkpoint(config, seed=5)
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    quantized, dequantized = qc.write_quantized(src, tmp_path, fp8, qc.fp8_block(32, 32))
    _, params, _ = load_model(quantized, dtype="float32", progress=False)
    experts = params["layers"][0]["we_gate"]
    assert isinstance(experts, QuantizedWeight) and experts.shape == (4, 64, 32)
    assert experts.scale.shape == (4, 2, 1)
    assert _relative(prompt_logits(quantized), prompt_logits(dequantized)) <= REFERENCE_TOL


def test_the_engine_serves_fp8_block_experts_through_the_kernels(build_checkpoint, tiny_tokenizer_dir, tmp_path,
                                                                 monkeypatch):
    """Qwen3-FP8's layout (128 × 128 blocks here 16 × 16) through `LLM` with the experts on the grouped-matmul kernels
    (interpret mode), which read the float8 stacks and apply each block's scale per K step: the dequantized
    checkpoint's greedy tokens, logprobs within 1e-4 (float32, weight-only math)."""
    from jengine import LLM, SamplingParams
    from jengine.layers import mlp
    from tests.kernels.test_grouped_matmul import ReferenceAttentionKernelExperts

    config = Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 2}, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2, norm_topk_prob=True)
    src, _ = build_checkpoint(config, seed=6, tokenizer_dir=tiny_tokenizer_dir)
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    quantized, dequantized = qc.write_quantized(src, tmp_path, fp8, qc.fp8_block(16, 16))
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=5, logprobs=1)

    def greedy(path) -> tuple[list, np.ndarray]:
        with LLM(str(path), tokenizer=str(src), dtype="float32", max_model_len=64) as llm:
            out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in out],
                np.array([[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                          for o in out]))

    want_tokens, want_logprobs = greedy(dequantized)
    monkeypatch.setattr("jengine.factory.select_backend", lambda *a, **k: ReferenceAttentionKernelExperts())
    kinds = []
    read = mlp.expert_operands
    monkeypatch.setattr(mlp, "expert_operands", lambda *a, **k: kinds.append((ops := read(*a, **k)).kind) or ops)
    tokens, logprobs = greedy(quantized)
    assert set(kinds) == {"block"}  # the float8 stacks reached the kernels with their block scales
    assert tokens == want_tokens
    assert np.abs(logprobs - want_logprobs).max() <= 1e-4


@pytest.mark.parametrize(("config", "message"), [
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({"quant_method": "gptq", "bits": 3}, "GPTQ with 3 bits is not supported"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    (qc.ct_config("pack-quantized", {"type": "int", "strategy": "group", "group_size": 128, "num_bits": 4},
                  {"type": "int", "strategy": "token", "num_bits": 8}), "W4A16 only"),
    (qc.ct_config("nvfp4-pack-quantized", {"type": "float", "strategy": "tensor_group", "num_bits": 4}, None),
     "format 'nvfp4-pack-quantized'"),
    (qc.ct_config("int-quantized", {"type": "int", "strategy": "channel", "symmetric": False}, None),
     "asymmetric"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "weight_block_size [128, 128] with activation_scheme 'static'"),
])
def test_unsupported_quantization_is_refused_by_name(llama, tmp_path, config, message):
    quantized, _ = qc.write_quantized(llama, tmp_path, config, qc.fp8_tensor())
    with pytest.raises(UnsupportedModelError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_model(quantized, dtype="float32", progress=False)


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_a_float8_kv_cache_scheme_loads_its_scales(llama, tmp_path, strategy):
    """llm-compressor's FP8 checkpoints made for a float8 KV cache (`kv_cache_scheme`, `self_attn.k_scale` /
    `v_scale` per layer or per KV head) load: the projections as their format says, the scales as each layer's
    float32 `kv_scale [K/V, heads]`, which `kv_cache_dtype="fp8"` stores the cache with."""
    from safetensors.numpy import save_file

    config = {**FORMATS["ct-float-channel-token"][0], "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}}
    quantized, dequantized = qc.write_quantized(llama, tmp_path, config, FORMATS["ct-float-channel-token"][1])
    layers, heads = 2, COMMON["num_key_value_heads"]
    values = np.random.default_rng().uniform(0.002, 0.02, (layers, 2, heads if strategy == "attn_head" else 1))
    save_file({f"model.layers.{i}.self_attn.{kv}_scale": values[i, j].astype(np.float32).reshape(
        (heads,) if strategy == "attn_head" else ()) for i in range(layers) for j, kv in enumerate("kv")},
        str(quantized / "kv_scales.safetensors"))
    _, params, _ = load_model(quantized, dtype="float32", progress=False)
    got = np.stack([np.asarray(layer["kv_scale"]) for layer in params["layers"]])
    np.testing.assert_array_equal(got, np.broadcast_to(values.astype(np.float32), (layers, 2, heads)))
    assert isinstance(params["layers"][0]["wqkv"], QuantizedWeight)
    assert _relative(prompt_logits(quantized), prompt_logits(dequantized)) <= REFERENCE_TOL


@pytest.mark.parametrize(("scheme", "message"), [
    ({"num_bits": 8, "type": "int", "strategy": "tensor"}, "kv_cache_scheme of 8-bit int values"),
    ({"num_bits": 4, "type": "float", "strategy": "tensor"}, "kv_cache_scheme of 4-bit float values"),
    ({"num_bits": 8, "type": "float", "strategy": "token"}, "kv_cache_scheme with strategy 'token'"),
    ({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": False}, "symmetric: False"),
])
def test_other_kv_cache_schemes_are_refused_by_name(llama, tmp_path, scheme, message):
    config = {**FORMATS["ct-float-channel-token"][0], "kv_cache_scheme": scheme}
    quantized, _ = qc.write_quantized(llama, tmp_path, config, FORMATS["ct-float-channel-token"][1])
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(quantized, dtype="float32", progress=False)


def test_the_most_specific_config_group_wins():
    """compressed-tensors ranks a module's matching groups: its exact name, then a `re:` regex, then `Linear`,
    whatever their order in the config."""
    from jengine.models.quant_config import read_quant_config

    per_tensor = {"type": "float", "strategy": "tensor"}
    static = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}  # `dynamic` left out: False
    config = qc.ct_config("float-quantized", {"type": "float", "strategy": "channel"},
                          {"type": "float", "strategy": "token", "dynamic": True})
    groups = config["config_groups"]
    groups["group_1"] = {"targets": ["re:.*down_proj$"], "weights": {**groups["group_0"]["weights"], **per_tensor},
                         "input_activations": static}
    groups["group_2"] = {"targets": ["model.layers.1.mlp.down_proj"], "weights": groups["group_0"]["weights"],
                         "input_activations": None}
    quant = read_quant_config({"quantization_config": config}, None)
    assert not quant.module("model.layers.0.self_attn.q_proj").static_input
    down = quant.module("model.layers.0.mlp.down_proj")
    assert down.static_input and down.scheme.activations == "fp8"
    assert quant.module("model.layers.1.mlp.down_proj").scheme.activations is None
    assert quant.module("lm_head") is None


def test_modelopt_settings_in_hf_quant_config_json(llama, tmp_path):
    """ModelOpt checkpoints whose config.json has no quantization_config: its hf_quant_config.json is read (the
    same logits as with the settings in config.json); other algorithms refused by name."""
    import json

    config, quantize = FORMATS["modelopt-fp8"]
    quantized, dequantized = qc.write_quantized(llama, tmp_path, config, quantize)
    hf = json.loads((quantized / "config.json").read_text())
    del hf["quantization_config"]
    (quantized / "config.json").write_text(json.dumps(hf))
    settings = {k: v for k, v in config.items() if k != "quant_method"}
    (quantized / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, **settings}))
    assert _relative(prompt_logits(quantized), prompt_logits(dequantized)) <= REFERENCE_TOL
    for algo, named in (("NVFP4", "quant_algo 'NVFP4'"), ("FP8", "kv_cache_quant_algo 'NVFP4'")):
        kv = "NVFP4" if algo == "FP8" else None
        (quantized / "hf_quant_config.json").write_text(json.dumps(
            {"quantization": {"quant_algo": algo, "kv_cache_quant_algo": kv}}))
        with pytest.raises(UnsupportedModelError, match=named):
            load_model(quantized, dtype="float32", progress=False)


def test_frozen_and_dense_compressed_tensors_checkpoints_load(llama, tmp_path):
    """`quantization_status: frozen` (quantized values saved as their format says) and a `dense` sparsity config
    (plain tensors) read as a compressed checkpoint does."""
    config, quantize = FORMATS["ct-float-channel-token"]
    config = {**config, "quantization_status": "frozen", "sparsity_config": {"format": "dense"},
              "transform_config": {}}
    quantized, dequantized = qc.write_quantized(llama, tmp_path, config, quantize)
    assert _relative(prompt_logits(quantized), prompt_logits(dequantized)) <= REFERENCE_TOL


@pytest.mark.parametrize(("extra", "message"), [
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config of format 'sparse-24-bitmask'"),
    ({"transform_config": {"config_groups": {"u": {"type": "hadamard"}}}}, "transform_config"),
    ({"quantization_status": "initialized"}, "quantization_status 'initialized'"),
])
def test_compressed_tensors_extras_refused_by_name(llama, tmp_path, extra, message):
    config, quantize = FORMATS["ct-float-channel-token"]
    quantized, _ = qc.write_quantized(llama, tmp_path, {**config, **extra}, quantize)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(quantized, dtype="float32", progress=False)


def test_activation_ordered_8bit_groups_are_refused(llama, tmp_path):
    config = FORMATS["ct-pack8-group32"][0]
    group = config["config_groups"]["group_0"]
    config = {**config, "config_groups": {"group_0": {**group, "weights": {**group["weights"], "actorder": "group"}}}}
    quantized, _ = qc.write_quantized(llama, tmp_path, config, FORMATS["ct-pack8-group32"][1])
    with pytest.raises(UnsupportedModelError, match="actorder 'group'"):
        load_model(quantized, dtype="float32", progress=False)


def test_a_quantization_flag_that_does_not_match_the_checkpoint_is_refused(llama, tmp_path):
    quantized, _ = qc.write_quantized(llama, tmp_path, FORMATS["ct-int-channel-token"][0], qc.channel("int"))
    with pytest.raises(UnsupportedModelError, match="does not match the checkpoint's quant_method"):
        load_model(quantized, quantization="fp8", progress=False)
    with pytest.raises(UnsupportedModelError, match="quantization='awq' is not supported"):
        load_model(llama, quantization="awq", progress=False)


def test_the_engine_serves_a_quantized_checkpoint_alike_over_two_devices(build_checkpoint, tiny_tokenizer_dir,
                                                                        tmp_path, caplog, name="fp8-block"):
    """Through `LLM`, on one device and split over two (the scales sharded with their weights): the same greedy
    tokens, chosen-token logprobs within 1e-4; the start-up log names the format."""
    from jengine import LLM, SamplingParams

    src, _ = build_checkpoint(LlamaConfig(**{**COMMON, "num_hidden_layers": 2}), seed=4,
                              tokenizer_dir=tiny_tokenizer_dir)
    config, quantize = FORMATS[name]
    quantized, _ = qc.write_quantized(src, tmp_path, config, quantize)
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=1)
    results = []
    for tp in (1, 2):
        with caplog.at_level("INFO", logger="jengine.models.loader"):
            with LLM(str(quantized), dtype="float32", max_model_len=64, tensor_parallel_size=tp) as llm:
                out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                                 o.outputs[0].token_ids)])
                        for o in out])
    assert [tokens for tokens, _ in results[0]] == [tokens for tokens, _ in results[1]]
    assert np.abs(np.array([lp for _, lp in results[0]]) - np.array([lp for _, lp in results[1]])).max() <= 1e-4
    assert f"quantization: {config['quant_method']}" in caplog.text and "projections in 8 bits" in caplog.text


class _Gpu:
    """A device that reports memory: `in_use` bytes already taken (the placed weights)."""

    def __init__(self, in_use: int) -> None:
        self.in_use = in_use

    def memory_stats(self):
        return {"bytes_limit": 1 << 30, "bytes_in_use": self.in_use}


def test_the_kv_pool_gets_what_8bit_weights_save(llama, tmp_path):
    from jengine.config import CacheConfig, SchedulerConfig
    from jengine.layers.quant import workspace_bytes
    from jengine.runner.kv_storage import plan_kv_cache

    quantized, _ = qc.write_quantized(llama, tmp_path, FORMATS["fp8-block"][0], FORMATS["fp8-block"][1])
    cache, sched = CacheConfig(gpu_memory_utilization=1.0), SchedulerConfig(max_model_len=64)
    plans = []
    for model_dir in (llama, quantized):
        spec, params, dtype = load_model(model_dir, dtype="bfloat16", progress=False)
        weights = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
        workspace = workspace_bytes(params, dtype)
        plans.append((plan_kv_cache(spec, cache, sched, dtype, _Gpu(weights), workspace=workspace), weights,
                      workspace))
    (float_plan, float_bytes, none), (quant_plan, quant_bytes, workspace) = plans
    assert none == 0 and 0 < workspace < float_bytes - quant_bytes
    gained = (float_bytes - quant_bytes - workspace) / float_plan.bytes_per_block
    assert abs(quant_plan.num_blocks - float_plan.num_blocks - gained) <= 1
