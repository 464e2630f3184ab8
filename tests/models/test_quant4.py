"""AWQ, GPTQ and compressed-tensors W4A16 checkpoints, packed by the tests' own packers (`quant4_packing.py`), load
with the logits of the HF model holding the same dequantized weights (float32, 1e-4 · max|ref|); the unpackers
agree with compressed-tensors' own unpack; unsupported variants are refused by name."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, Qwen2MoeConfig, Qwen3MoeConfig

from jengine.errors import CheckpointError, UnsupportedModelError
from jengine.layers.quant4 import Int4Experts, Int4Weight
from jengine.models.loader import load_model
from jengine.models.quant4 import unpack_awq, unpack_compressed_tensors, unpack_gptq
from jengine.models.quant4_load import read_quant4_config
from jengine.runner.simple import SimpleGenerator
from tests.conftest import COMMON
from tests.models.quant4_packing import (
    _ct_words, dequantized, pack_awq, pack_columns, pack_rows, quantize_checkpoint, quantize_groups)

PROMPTS = [[1, 5, 9, 77, 300, 12, 4], [1, 200, 3, 3, 8]]


def dequantized_count(log: str) -> int:
    """Projections the load log says were dequantized, over every reason's line."""
    return sum(int(n) for n in re.findall(r"(\d+) projections unpacked and dequantized at load", log))


def prompt_logits(model_dir) -> tuple[list[np.ndarray], dict]:
    spec, params, dtype = load_model(model_dir, dtype="float32", progress=False)
    generator = SimpleGenerator(spec, params, dtype, block_size=4)
    return generator.generate(PROMPTS, 1, return_prompt_logits=True).prompt_logits, params


def _check_logits(model_dir, model) -> dict:
    logits, params = prompt_logits(model_dir)
    for prompt, ours in zip(PROMPTS, logits, strict=True):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].numpy()
        assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    return params


@pytest.mark.parametrize("fmt,kwargs", [
    ("awq", {}),
    ("awq", dict(group=-1)),
    ("gptq", dict(symmetric=True, v1=True)),
    ("gptq", dict(symmetric=False, v1=False, desc_act=True)),
    ("gptq", dict(bits=8, symmetric=False, v1=True, desc_act=True)),
    ("gptq", dict(bits=2, symmetric=False, v1=True)),
    ("ct", dict(symmetric=True)),
    ("ct", dict(symmetric=False)),
], ids=["awq", "awq-one-group", "gptq-v1-sym", "gptq-v2-asym-act-order", "gptq-8bit-v1-act-order", "gptq-2bit",
        "ct-sym", "ct-asym"])
def test_quantized_checkpoint_logits(build_checkpoint, fmt, kwargs, caplog):
    model_dir, _ = build_checkpoint(LlamaConfig(**COMMON))
    model = quantize_checkpoint(model_dir, fmt, **{"group": 32, **kwargs})
    with caplog.at_level(logging.INFO, logger="jengine.models.quant4_load"):
        _check_logits(model_dir, model)
    assert dequantized_count(caplog.text) == 21  # the tiny shapes' K (64, 96) are not whole 128-row steps


@pytest.mark.parametrize("fmt,kwargs", [
    ("gptq", dict(symmetric=True, v1=True)),
    ("awq", {}),
    ("ct", dict(symmetric=False)),
], ids=["gptq-v1-sym", "awq", "ct-asym"])
def test_moe_experts_kept_in_4_bits(build_checkpoint, fmt, kwargs, caplog):
    """Per-expert projections, as AWQ/GPTQ/compressed-tensors MoE checkpoints name them, stay packed as one
    `Int4Experts` stack per projection and layer (routers stay float), with the logits of the HF model holding the
    dequantized weights; attention (64 input rows, not a whole step of the dense W4A16 kernel) is dequantized."""
    config = Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    model_dir, _ = build_checkpoint(config)
    model = quantize_checkpoint(model_dir, fmt, group=32, **kwargs)
    with caplog.at_level(logging.INFO, logger="jengine.models.quant4_load"):
        params = _check_logits(model_dir, model)
    assert "36 projections kept in 4 bits" in caplog.text  # 3 layers × 4 experts × 3
    assert dequantized_count(caplog.text) == 12  # attention: K of 64 is not a whole 128-row step
    for layer in params["layers"]:
        for name, shape in (("we_gate", (4, 64, 64)), ("we_up", (4, 64, 64)), ("we_down", (4, 64, 64))):
            stack = layer[name]
            assert isinstance(stack, Int4Experts) and stack.shape == shape and stack.group == 32
            assert stack.packed.nbytes * 2 == np.prod(shape)  # half a byte a weight


def test_qwen2_moe_shared_expert_kept_in_4_bits(build_checkpoint, caplog):
    """Qwen1.5-MoE-AWQ's layout: the routed experts stacked in 4 bits and the shared expert's projections packed as
    a dense MLP's (its down: 128 input rows, one kernel step); its [1, d] gate stays float. Logits of the HF model
    holding the dequantized weights."""
    config = Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                            shared_expert_intermediate_size=128)
    model_dir, _ = build_checkpoint(config)
    model = quantize_checkpoint(model_dir, "awq", group=32)
    params = _check_logits(model_dir, model)
    for layer in params["layers"]:
        assert isinstance(layer["we_down"], Int4Experts) and isinstance(layer["ws_down"], Int4Weight)
        assert layer["ws_gate"].shape == (64, 1) and jnp.issubdtype(layer["ws_gate"].dtype, jnp.floating)


def test_moe_experts_in_activation_order_stay_packed(build_checkpoint, caplog):
    """GPTQ's desc_act orders each expert's rows its own way: the stacks stay packed, rows sorted by group, gate's and
    up's order kept for the activations and down's folded into their columns; the logits are the dequantized
    model's."""
    config = Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    model_dir, _ = build_checkpoint(config)
    model = quantize_checkpoint(model_dir, "gptq", group=32, symmetric=False, desc_act=True)
    with caplog.at_level(logging.INFO, logger="jengine.models.quant4_load"):
        params = _check_logits(model_dir, model)
    assert "36 projections kept in 4 bits" in caplog.text
    layer = params["layers"][0]
    assert all(isinstance(layer[name], Int4Experts) for name in ("we_gate", "we_up", "we_down"))
    assert layer["we_gate"].perm.shape == (4, 64) and layer["we_down"].perm is None
    assert not np.array_equal(np.asarray(layer["we_gate"].perm[0]), np.arange(64))


@pytest.mark.parametrize("group", [128, 64])
def test_awq_unpack_groups(group):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(256, 64)).astype(np.float32)
    q, zeros, scales, g_idx = quantize_groups(w, group, 4, symmetric=False)
    unpacked = unpack_awq(pack_awq(q), pack_awq(zeros), scales.astype(np.float16), group)
    np.testing.assert_array_equal(unpacked.values, q)
    np.testing.assert_allclose(unpacked.dequantize(), dequantized(q, zeros, scales, g_idx), rtol=0, atol=1e-6)


def test_gptq_act_order_perm_makes_groups_contiguous():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(256, 32)).astype(np.float32)
    g_idx = rng.permutation(np.arange(256) // 64)
    q, zeros, scales, g_idx = quantize_groups(w, 64, 4, symmetric=False, g_idx=g_idx)
    unpacked = unpack_gptq(pack_rows(q, 4), pack_columns(zeros, 4), scales, g_idx.astype(np.int32), 4, 64, False)
    assert unpacked.perm is not None and np.all(np.diff(unpacked.g_idx[unpacked.perm]) >= 0)
    np.testing.assert_allclose(unpacked.dequantize(), dequantized(q, zeros, scales, g_idx), atol=1e-6)


def test_compressed_tensors_unpack_agrees_with_the_library():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    rng = np.random.default_rng(2)
    signed = rng.integers(-8, 8, size=(32, 128))
    zero_signed = rng.integers(-8, 8, size=(32, 2))
    packed = pack_to_int32(torch.from_numpy(signed).to(torch.int8), 4).numpy()
    zp = pack_to_int32(torch.from_numpy(zero_signed).to(torch.int8), 4, packed_dim=0).numpy()
    scale = rng.uniform(0.01, 0.1, size=(32, 2)).astype(np.float32)
    unpacked = unpack_compressed_tensors(packed, scale, zp, (32, 128))
    expected = (signed - np.repeat(zero_signed, 64, axis=1)) * np.repeat(scale, 64, axis=1)
    np.testing.assert_allclose(unpacked.dequantize().T, expected, rtol=1e-6)
    np.testing.assert_array_equal(pack_columns(signed + 8, 4), packed)  # the tests' packer writes the same words
    np.testing.assert_array_equal(_ct_words(zero_signed.T + 8), zp)


def test_compressed_tensors_groups_with_a_short_last_one():
    """K = 200 in groups of 128: ⌈200 / 128⌉ = 2 scale columns (compressed-tensors' group count), the second
    covering inputs 128-199 (not 100-199), packed by the library."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    rng = np.random.default_rng()
    signed = rng.integers(-8, 8, size=(16, 200))
    scale = rng.uniform(0.01, 0.1, size=(16, 2)).astype(np.float32)
    packed = pack_to_int32(torch.from_numpy(signed).to(torch.int8), 4).numpy()
    expected = signed * scale[:, np.arange(200) // 128]
    unpacked = unpack_compressed_tensors(packed, scale, None, (16, 200), group_sizes=(128,))
    np.testing.assert_allclose(unpacked.dequantize().T, expected, rtol=1e-6)
    with pytest.raises(CheckpointError, match="2 scale groups fit no group size of the config"):
        unpack_compressed_tensors(packed, scale, None, (16, 200), group_sizes=(64,))


@pytest.mark.parametrize("fmt,side_file,settings", [
    # AutoAWQ's own file and spellings
    ("awq", "quant_config.json", {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}),
    # AutoGPTQ ≤ 0.4: no quant_method, v1 zeros
    ("gptq", "quantize_config.json", {"bits": 4, "group_size": 32, "damp_percent": 0.01, "desc_act": True,
                                      "sym": False, "true_sequential": True, "model_file_base_name": "model"}),
])
def test_settings_in_a_side_file_are_read(build_checkpoint, caplog, fmt, side_file, settings):
    """Checkpoints whose config.json carries no quantization_config, the settings beside it as their tools wrote
    them, load as the same checkpoint with them in config.json."""
    model_dir, _ = build_checkpoint(LlamaConfig(**COMMON))
    model = quantize_checkpoint(model_dir, fmt, group=32, desc_act=settings.get("desc_act", False), v1=True)
    config = json.loads((model_dir / "config.json").read_text())
    del config["quantization_config"]
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / side_file).write_text(json.dumps(settings))
    with caplog.at_level(logging.INFO, logger="jengine.models"):
        _check_logits(model_dir, model)
    assert f"quantization settings ({fmt}) read from {side_file}" in caplog.text


def test_a_side_file_naming_no_method_is_passed_over(build_checkpoint, caplog):
    """Another tool's quant_config.json beside a float checkpoint: a warning, and the model loads as float."""
    model_dir, model = build_checkpoint(LlamaConfig(**COMMON))
    (model_dir / "quant_config.json").write_text(json.dumps({"group_size": 64, "bits": 4, "mode": "affine"}))
    with caplog.at_level(logging.WARNING, logger="jengine.models"):
        _check_logits(model_dir, model)
    assert "names no quant_method" in caplog.text


@pytest.mark.parametrize("qc,named", [
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "gemv"),
    ({"quant_method": "awq", "bits": 4, "version": "exllama"}, "exllama"),
    ({"quant_method": "gptq", "bits": 3}, "3 bits"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "Marlin"),
    ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "Marlin"),
    ({"quant_method": "awq_marlin"}, "Marlin"),
    ({"quant_method": "awq", "bits": 4, "backend": "llm-awq"}, "llm-awq"),
    ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int16"}, "pack_dtype 'int16'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128,
      "dynamic": {"-:.*lm_head": {}, "+:.*down_proj": {"bits": 8}}}, r"'\+:\.\*down_proj' sets \{'bits': 8\}"),
])
def test_unsupported_variants_refused_by_name(qc, named):
    with pytest.raises(UnsupportedModelError, match=named):
        read_quant4_config({"quantization_config": qc})


# Shapes the W4A16 kernel tiles: K multiples of its 128-row groups, N of its column strips.
KERNEL_SHAPED = COMMON | dict(hidden_size=128, intermediate_size=256)
PACKED = ("wqkv", "wo", "w_gate_up", "w_down")


@pytest.mark.parametrize("fmt,kwargs", [
    ("awq", {}),
    ("gptq", dict(symmetric=False, v1=False, desc_act=True)),
    ("ct", dict(symmetric=False)),
], ids=["awq", "gptq-act-order", "ct-asym"])
def test_kept_in_4_bits_with_the_dequantized_models_logits(build_checkpoint, fmt, kwargs, caplog):
    """Group 128: every projection stays packed (4 bits a weight, float16 group scales and zeros) and the logits
    are the float32 dequantized model's within 1e-4 · max|ref|."""
    model_dir, _ = build_checkpoint(LlamaConfig(**KERNEL_SHAPED))
    model = quantize_checkpoint(model_dir, fmt, group=128, **kwargs)
    with caplog.at_level(logging.INFO, logger="jengine.models.quant4_load"):
        params = _check_logits(model_dir, model)
    assert "21 projections kept in 4 bits" in caplog.text and "dequantized" not in caplog.text
    for layer in params["layers"]:
        for name in PACKED:
            w = layer[name]
            assert isinstance(w, Int4Weight) and w.packed.dtype == np.int32
            k, n = w.shape
            assert w.packed.nbytes * 2 == k * n  # half a byte per weight
            assert w.zeros.nbytes + w.scales.nbytes == 4 * (k // 128) * n
            # activation order reorders rows only across groups: down_proj's 256 inputs are two of them
            assert (w.perm is not None) == ("desc_act" in kwargs and name == "w_down")


@pytest.mark.parametrize("group", [32, 64])
def test_small_groups_stay_packed(build_checkpoint, caplog, group):
    """GPTQ/AWQ groups of 32 and 64 rows: every projection stays packed (one zero point and scale per word row in
    the decode kernel), with the dequantized model's logits."""
    model_dir, _ = build_checkpoint(LlamaConfig(**KERNEL_SHAPED))
    model = quantize_checkpoint(model_dir, "awq", group=group)
    with caplog.at_level(logging.INFO, logger="jengine.models.quant4_load"):
        params = _check_logits(model_dir, model)
    assert "21 projections kept in 4 bits" in caplog.text and "dequantized" not in caplog.text
    w = params["layers"][0]["wqkv"]
    assert isinstance(w, Int4Weight) and w.group == group and w.zeros.shape[0] == 128 // group


def test_groups_the_kernel_cannot_take_are_dequantized_with_a_reason(build_checkpoint, caplog):
    model_dir, _ = build_checkpoint(LlamaConfig(**KERNEL_SHAPED))
    model = quantize_checkpoint(model_dir, "gptq", group=48, symmetric=True, v1=True)  # 128 rows: a short last group
    with caplog.at_level(logging.INFO, logger="jengine.models.quant4_load"):
        params = _check_logits(model_dir, model)
    assert "21 projections unpacked and dequantized at load" in caplog.text
    assert "groups of unequal sizes" in caplog.text
    assert not isinstance(params["layers"][0]["wqkv"], Int4Weight)


def test_tensor_parallel_splits_that_break_groups_dequantize_with_a_reason(build_checkpoint, caplog):
    """Over 2 devices o_proj's 128 input features are half a group each: it reads as float, and the log says so;
    the projections that split whole stay packed."""
    model_dir, _ = build_checkpoint(LlamaConfig(**KERNEL_SHAPED))
    quantize_checkpoint(model_dir, "awq", group=128)
    with caplog.at_level(logging.INFO, logger="jengine.models.quant4_load"):
        _, params, _ = load_model(model_dir, dtype="float32", progress=False, projection_shards=2)
    assert "18 projections kept in 4 bits" in caplog.text
    assert ("3 projections unpacked and dequantized at load" in caplog.text
            and "why: tensor parallelism: 128 input features over 2 devices is not whole groups of 128" in caplog.text)
    layer = params["layers"][0]
    assert not isinstance(layer["wo"], Int4Weight)
    assert all(isinstance(layer[name], Int4Weight) for name in ("wqkv", "w_gate_up", "w_down"))


TP_SHAPED = COMMON | dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=64)


@pytest.mark.parametrize("tp,group", [(2, 128), (4, 128), (2, 32)])
def test_packed_weights_split_over_devices_serve_as_the_dequantized_model(build_checkpoint, tiny_tokenizer_dir, tp,
                                                                          group):
    """Tensor parallelism keeps every projection in 4 bits, each device holding its columns (q/k/v, gate/up) or its
    whole groups of rows (o, down; GPTQ's activation order included; 32-row groups whole 128-row steps), and serves
    the float32 dequantized checkpoint's greedy tokens on one device, logprobs within 1e-4. At 4 devices the 2 KV
    heads are repeated."""
    from tests.parallel.test_tensor_parallel import generate

    model_dir, _ = build_checkpoint(LlamaConfig(**TP_SHAPED), tokenizer_dir=tiny_tokenizer_dir)
    quantize_checkpoint(model_dir, "gptq", group=group, symmetric=False, desc_act=True)
    want_tokens, want_logprobs, llm = generate(model_dir.with_name(model_dir.name + "-dequantized"), PROMPTS,
                                               tokenizer=str(model_dir))
    llm.shutdown()
    tokens, logprobs, llm = generate(model_dir, PROMPTS, tensor_parallel_size=tp)
    layer = llm._core.runner.params["layers"][0]
    llm.shutdown()
    assert tokens == want_tokens
    assert np.abs(logprobs - want_logprobs).max() <= 1e-4
    for name, split in (("wqkv", "columns"), ("wo", "rows"), ("w_gate_up", "columns"), ("w_down", "rows")):
        w = layer[name]
        assert isinstance(w, Int4Weight) and w.split == split
        axis = 0 if split == "rows" else 1
        assert w.packed.addressable_shards[0].data.shape[axis] * tp == w.packed.shape[axis]


def test_the_engine_serves_packed_weights_as_the_dequantized_model(build_checkpoint, tiny_tokenizer_dir):
    """Through `LLM`: the same greedy tokens as the float32 dequantized checkpoint, logprobs within 1e-4."""
    from jengine import LLM, SamplingParams

    model_dir, _ = build_checkpoint(LlamaConfig(**KERNEL_SHAPED), tokenizer_dir=tiny_tokenizer_dir)
    quantize_checkpoint(model_dir, "gptq", group=128, symmetric=False, desc_act=True)
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=5, logprobs=1)
    runs = []
    for path in (model_dir, model_dir.with_name(model_dir.name + "-dequantized")):
        with LLM(str(path), tokenizer=str(model_dir), dtype="float32", max_model_len=64) as llm:
            out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                               o.outputs[0].token_ids)]) for o in out])
    assert [tokens for tokens, _ in runs[0]] == [tokens for tokens, _ in runs[1]]
    assert np.abs(np.array([lp for _, lp in runs[0]]) - np.array([lp for _, lp in runs[1]])).max() <= 1e-4


def test_weights_take_4_bit_bytes(build_checkpoint):
    """What the KV planner measures after loading: the projections at 4.25 bits a weight, not 32."""
    import jax

    model_dir, _ = build_checkpoint(LlamaConfig(**KERNEL_SHAPED))
    quantize_checkpoint(model_dir, "awq", group=128)
    float_dir = model_dir.with_name(model_dir.name + "-dequantized")
    sizes = []
    for path in (model_dir, float_dir):
        _, params, _ = load_model(path, dtype="float32", progress=False)
        sizes.append(sum(leaf.nbytes for layer in params["layers"] for name in PACKED
                         for leaf in jax.tree.leaves(layer[name])))
    packed, full = sizes
    assert packed == full * 4.25 / 32  # half a byte a weight + float16 zeros and scales per 128 (float32: 4)


MOE_SHAPED = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


def _llm_greedy(path, tokenizer, **engine) -> tuple[list, np.ndarray, dict]:
    from jengine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=5, logprobs=1)
    with LLM(str(path), tokenizer=str(tokenizer), dtype="float32", max_model_len=64, **engine) as llm:
        out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        core = llm._core
        assert not core.has_unfinished() and core.kv_manager.num_free_blocks == core.kv_manager.num_blocks
        layer = core.runner.params["layers"][0]
    tokens = [o.outputs[0].token_ids for o in out]
    logprobs = np.array([[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                         for o in out])
    return tokens, logprobs, layer


@pytest.mark.parametrize("fmt,kwargs", [("awq", {}), ("gptq", dict(symmetric=False, desc_act=True))],
                         ids=["awq", "gptq-act-order"])
def test_the_engine_serves_packed_experts_through_the_kernels(build_checkpoint, tiny_tokenizer_dir, monkeypatch,
                                                              fmt, kwargs):
    """Through `LLM` with the experts on the grouped-matmul kernels (interpret mode, reading the 4-bit words; GPTQ's
    activation order gathered): the float32 dequantized checkpoint's greedy tokens, logprobs within 1e-4."""
    from tests.kernels.test_grouped_matmul import ReferenceAttentionKernelExperts

    model_dir, _ = build_checkpoint(Qwen3MoeConfig(**COMMON, **MOE_SHAPED), tokenizer_dir=tiny_tokenizer_dir)
    quantize_checkpoint(model_dir, fmt, group=32, **kwargs)
    want_tokens, want_logprobs, _ = _llm_greedy(model_dir.with_name(model_dir.name + "-dequantized"), model_dir)
    monkeypatch.setattr("jengine.factory.select_backend", lambda *a, **k: ReferenceAttentionKernelExperts())
    tokens, logprobs, layer = _llm_greedy(model_dir, model_dir)
    assert isinstance(layer["we_down"], Int4Experts)
    assert tokens == want_tokens
    assert np.abs(logprobs - want_logprobs).max() <= 1e-4


@pytest.mark.parametrize("desc_act", [False, True], ids=["natural", "act-order"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_packed_experts_split_over_devices_serve_as_the_dequantized_model(build_checkpoint, tiny_tokenizer_dir,
                                                                         expert_parallel, desc_act):
    """Over 2 devices the stacks stay packed: split by columns (gate, up) and whole groups of rows (down) under TP,
    by expert under EP (activation order too); the greedy tokens are the float32 dequantized checkpoint's on one
    device."""
    model_dir, _ = build_checkpoint(Qwen3MoeConfig(**COMMON, **MOE_SHAPED), tokenizer_dir=tiny_tokenizer_dir)
    quantize_checkpoint(model_dir, "gptq", group=32, symmetric=False, desc_act=desc_act)
    want_tokens, want_logprobs, _ = _llm_greedy(model_dir.with_name(model_dir.name + "-dequantized"), model_dir)
    tokens, logprobs, layer = _llm_greedy(model_dir, model_dir, tensor_parallel_size=2,
                                          enable_expert_parallel=expert_parallel)
    assert tokens == want_tokens
    assert np.abs(logprobs - want_logprobs).max() <= 1e-4
    for name, axis in (("we_gate", 2), ("we_up", 2), ("we_down", 1)):
        stack = layer[name]
        assert isinstance(stack, Int4Experts)
        split = 0 if expert_parallel else axis
        assert stack.packed.addressable_shards[0].data.shape[split] * 2 == stack.packed.shape[split]


def test_tensor_parallel_splits_that_break_expert_groups_dequantize_with_a_reason(build_checkpoint, caplog):
    """Groups of 64 over 2 devices leave half a group of the down projection's rows on each: the down stacks read
    as float, and the log says why; gate and up (split by columns) stay packed."""
    model_dir, _ = build_checkpoint(Qwen3MoeConfig(**COMMON, **MOE_SHAPED))
    quantize_checkpoint(model_dir, "awq", group=64)
    from jengine.parallel.mesh import TP_AXIS
    from jengine.parallel.sharding import ParallelLayout

    mesh = jax.make_mesh((2,), (TP_AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
    layout = ParallelLayout(mesh, expert_parallel=False, kv_head_repeat=1, shard_vocab=True)
    with caplog.at_level(logging.INFO, logger="jengine.models.quant4_load"):
        _, params, _ = load_model(model_dir, dtype="float32", progress=False, projection_shards=2,
                                  sharding=layout.param_sharding)
    assert ("why: tensor parallelism: 32 of the experts' input rows on each device is not whole groups of 64"
            in caplog.text)
    assert "12 projections unpacked and dequantized" in caplog.text  # 3 layers × 4 experts' down
    layer = params["layers"][0]
    assert isinstance(layer["we_gate"], Int4Experts) and isinstance(layer["we_up"], Int4Experts)
    assert not isinstance(layer["we_down"], Int4Experts)


def _keep_float(model_dir, modules: list[str]) -> None:
    """Stores these modules in float, as checkpoints that leave some projections unquantized do (the float weight
    is the dequantized one the reference model holds, so the logits stay comparable)."""
    from safetensors.numpy import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    held = load_file(str(model_dir.with_name(model_dir.name + "-dequantized") / "model.safetensors"))
    for module in modules:
        for name in [n for n in tensors if n.startswith(module + ".")]:
            del tensors[name]
        tensors[module + ".weight"] = held[module + ".weight"]
    save_file(tensors, str(path))


def test_projections_a_checkpoint_keeps_in_float_read_as_float(build_checkpoint, caplog):
    """A 4-bit checkpoint with some modules stored in float (layer 0's o_proj and one expert's down_proj): those leaves
    run in float, every other stays packed, and the logits are the dequantized model's."""
    config = Qwen3MoeConfig(**{**COMMON, "hidden_size": 128}, **MOE_SHAPED)
    model_dir, _ = build_checkpoint(config)
    model = quantize_checkpoint(model_dir, "awq", group=32)
    _keep_float(model_dir, ["model.layers.0.self_attn.o_proj", "model.layers.1.mlp.experts.2.down_proj"])
    with caplog.at_level(logging.INFO, logger="jengine.models.quant4_load"):
        params = _check_logits(model_dir, model)
    assert "modules not stored in a packed 4-bit format" in caplog.text
    assert isinstance(params["layers"][0]["we_down"], Int4Experts)
    layer = params["layers"][1]  # its down stack has a float expert; gate and up stay packed
    assert not isinstance(layer["we_down"], Int4Experts) and isinstance(layer["we_gate"], Int4Experts)


@pytest.mark.parametrize("v1", [True, False], ids=["gptq-v1", "gptq-v2"])
def test_8bit_gptq_is_kept_in_8_bits(build_checkpoint, caplog, v1):
    """Symmetric 8-bit GPTQ (Qwen's GPTQ-Int8 layout): every projection and expert stack runs as int8 weights with
    group scales on the 8-bit path (a byte a weight), with the dequantized model's logits."""
    from jengine.layers.quant import QuantizedWeight

    model_dir, _ = build_checkpoint(Qwen3MoeConfig(**COMMON, **MOE_SHAPED))
    model = quantize_checkpoint(model_dir, "gptq", group=32, bits=8, symmetric=True, v1=v1)
    with caplog.at_level(logging.INFO, logger="jengine.models.quant4_load"):
        params = _check_logits(model_dir, model)
    assert "48 projections kept in 8 bits" in caplog.text and "dequantized" not in caplog.text
    layer = params["layers"][0]
    for name in ("wqkv", "wo", "we_gate", "we_down"):
        w = layer[name]
        assert isinstance(w, QuantizedWeight) and w.weight.dtype == np.int8, name
        assert (w.scheme.weight_dtype, w.scheme.activations, w.scheme.block_k, w.scheme.block_n) == ("int8", None,
                                                                                                      32, 1)
    assert layer["we_gate"].shape == (4, 64, 64)


def test_asymmetric_8bit_gptq_is_dequantized_with_a_reason(build_checkpoint, caplog):
    model_dir, _ = build_checkpoint(Qwen3MoeConfig(**COMMON, **MOE_SHAPED))
    model = quantize_checkpoint(model_dir, "gptq", group=32, bits=8, symmetric=False)
    with caplog.at_level(logging.INFO, logger="jengine.models.quant4_load"):
        _check_logits(model_dir, model)
    assert "why: asymmetric 8-bit zero points" in caplog.text


def test_the_engine_serves_8bit_gptq_experts_through_the_kernels(build_checkpoint, tiny_tokenizer_dir, monkeypatch):
    """The int8 expert stacks reach the grouped-matmul kernels (interpret mode) with their group scales as blocks:
    the dequantized checkpoint's greedy tokens, logprobs within 1e-4."""
    from jengine.layers import mlp
    from tests.kernels.test_grouped_matmul import ReferenceAttentionKernelExperts

    model_dir, _ = build_checkpoint(Qwen3MoeConfig(**COMMON, **MOE_SHAPED), tokenizer_dir=tiny_tokenizer_dir)
    quantize_checkpoint(model_dir, "gptq", group=32, bits=8, symmetric=True)
    want_tokens, want_logprobs, _ = _llm_greedy(model_dir.with_name(model_dir.name + "-dequantized"), model_dir)
    monkeypatch.setattr("jengine.factory.select_backend", lambda *a, **k: ReferenceAttentionKernelExperts())
    kinds = []
    read = mlp.expert_operands
    monkeypatch.setattr(mlp, "expert_operands", lambda *a, **k: kinds.append((ops := read(*a, **k)).kind) or ops)
    tokens, logprobs, _ = _llm_greedy(model_dir, model_dir)
    assert set(kinds) == {"block"}
    assert tokens == want_tokens
    assert np.abs(logprobs - want_logprobs).max() <= 1e-4


def test_channel_wise_groups_run_as_the_kernels_groups_of_128(build_checkpoint, caplog):
    """One group per projection (compressed-tensors' channel strategy; Llama's down_proj has 14,336 rows): the
    projections stay packed as groups of 128 sharing their scale and zero point, which the kernel compiles for
    (a 384-row group is no power of two, and no register tile), with the dequantized model's logits."""
    from tests.kernels.test_lowering import S, lower_for_h200
    from jengine.layers.quant4 import int4_matmul

    model_dir, _ = build_checkpoint(LlamaConfig(**{**KERNEL_SHAPED, "intermediate_size": 384}))
    model = quantize_checkpoint(model_dir, "ct", group=1 << 16, symmetric=False)  # one group of all the rows
    with caplog.at_level(logging.INFO, logger="jengine.models.quant4_load"):
        params = _check_logits(model_dir, model)
    assert "21 projections kept in 4 bits" in caplog.text
    down = params["layers"][0]["w_down"]
    assert down.group == 128 and down.zeros.shape == (3, 128)
    gpu = dataclasses.replace(down, impl="pallas")
    text = lower_for_h200(lambda x, w: int4_matmul(x, w), S((1, 384), jnp.bfloat16), gpu)
    assert "__gpu$xla.gpu.triton" in text
