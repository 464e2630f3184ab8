"""`jengine plan`: per-device weights, KV cache and activations from config.json alone, with the engine's own
arithmetic; the vLLM guide's example (a 70B Llama at TP 4 with 256 × 8,192 tokens needs 160 GiB of KV per rank)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from jengine.cli import main

LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False, "hidden_act": "silu"}
GIB = 1 << 30


@pytest.fixture
def config_only(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    return tmp_path


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    status = main(["plan", *args])
    return status, capsys.readouterr().out


def _gib(out: str, what: str) -> float:
    return float(re.search(rf"{what}\s+([\d.]+) GiB", out).group(1))


def test_the_vllm_guide_example_does_not_fit_an_80_gib_gpu(config_only: Path, capsys) -> None:
    status, out = _plan(capsys, str(config_only), "--tensor-parallel-size", "4", "--max-model-len", "8192",
                        "--max-num-seqs", "256", "--gpu-memory", "80")
    assert status == 1 and _gib(out, "KV cache") == 160.0  # 2 × 80 layers × 8 heads × 128 × 2 B × 2^21 tokens / 4
    assert 30 < _gib(out, "weights") < 36  # 70.6 B bf16 parameters over 4 devices
    assert "does not fit" in out and re.search(r"max-num-seqs ≤ \d+", out)
    fp8 = _plan(capsys, str(config_only), "-tp", "4", "--max-model-len", "8K", "--kv-cache-dtype", "fp8")[1]
    assert _gib(fp8, "KV cache") == 80.0


def test_what_would_fit_is_named(config_only: Path, capsys) -> None:
    status, out = _plan(capsys, str(config_only), "-tp", "1", "--max-model-len", "8192", "--max-num-seqs", "64")
    assert status == 1 and "needs TP ≥ 8" in out
    status, out = _plan(capsys, str(config_only), "-tp", "8", "--max-model-len", "8192", "--max-num-seqs", "64")
    assert status == 0 and out.splitlines()[-1].startswith("fits")
    quantized = _plan(capsys, str(config_only), "-tp", "8", "--quantization", "fp8", "--max-model-len", "8192")[1]
    assert _gib(quantized, "weights") < _gib(out, "weights") * 0.6


class _Device:
    """A device that reports its memory as a GPU does: 80 GiB, the weights already placed."""

    def __init__(self, in_use: int) -> None:
        self.in_use = in_use

    def memory_stats(self) -> dict[str, int]:
        return {"bytes_limit": 80 * GIB, "bytes_in_use": self.in_use}


def test_the_engine_planner_finds_the_same_blocks(config_only: Path) -> None:
    import jax.numpy as jnp

    from jengine.config import CacheConfig, SchedulerConfig
    from jengine.models.loader import load_spec
    from jengine.plan import PlanRequest, device_figures
    from jengine.runner.kv_storage import plan_kv_cache

    spec = load_spec(config_only)
    request = PlanRequest(4, 8192, 32, 2048, 16, 80 * GIB, 0.92, "auto", None)
    figures = device_figures(spec, request, 4, 32)
    engine = plan_kv_cache(spec, CacheConfig(), SchedulerConfig(max_num_seqs=32, max_model_len=8192), jnp.bfloat16,
                           _Device(figures.weights), kv_shards=4)
    assert figures.fits and engine.num_blocks == figures.kv_blocks_that_fit


# the 70B's projections (q, o, k, v; gate, up, down) and its embedding + LM head, counted from LLAMA_70B
PROJECTIONS_70B = 80 * (8192 * 128 * (2 * 64 + 2 * 8) + 3 * 8192 * 28672)
EMBEDDINGS_70B = 2 * 128256 * 8192


@pytest.mark.parametrize("quantization_config,bytes_per_weight", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}, 0.5 + 4 / 128),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32}, 0.5 + 4 / 32),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, 1.0),
])
def test_a_quantized_config_is_planned_in_its_own_bytes(tmp_path: Path, capsys, quantization_config,
                                                        bytes_per_weight):
    """Without --quantization, the config's quantization_config decides the projections' bytes (4 bits + float16
    scales and zeros per group; fp8 one byte): a 70B AWQ model fits one 141 GiB GPU with room for its KV cache."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B | {"quantization_config": quantization_config}))
    status, out = _plan(capsys, str(tmp_path), "--max-model-len", "8192", "--max-num-seqs", "16",
                        "--gpu-memory", "141")
    assert "weights as its quantization_config stores them" in out
    want = (PROJECTIONS_70B * bytes_per_weight + EMBEDDINGS_70B * 2) / GIB
    assert abs(_gib(out, "weights") - want) < 0.05  # the norms' 2 × 8192 a layer, counted with the projections
    assert status == 0


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_moe_parameters_are_counted_as_the_model_has_them(tmp_path: Path, family: str) -> None:
    """The plan's weights are HF's own parameter count (less the q/k/v biases it leaves out): routed experts, the
    router, and Qwen2-MoE's shared expert with its gate."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    from jengine.models.loader import load_spec
    from jengine.plan import parameter_counts

    common = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2)
    config = {"qwen2_moe": lambda: Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=48,
                                                  shared_expert_intermediate_size=80),
              "qwen3_moe": lambda: Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=48, head_dim=32),
              "mixtral": lambda: MixtralConfig(**common, num_local_experts=4)}[family]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    config.architectures = [type(model).__name__]
    config.save_pretrained(tmp_path)
    biases = sum(p.numel() for name, p in model.named_parameters() if name.endswith("_proj.bias"))
    assert sum(parameter_counts(load_spec(tmp_path))) == sum(p.numel() for p in model.parameters()) - biases


def test_the_plan_reserves_the_engines_workspace_for_8bit_experts(tmp_path: Path) -> None:
    """An FP8 MoE's step dequantizes expert stacks (two at once): the plan keeps the bytes the engine keeps."""
    import jax.numpy as jnp

    from jengine.layers.quant import workspace_bytes
    from jengine.models.dummy import dummy_model
    from jengine.models.loader import load_spec
    from jengine.plan import quantized_workspace

    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
              "intermediate_size": 512, "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "vocab_size": 512, "torch_dtype": "bfloat16",
              "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, params, dtype = dummy_model(str(tmp_path), dtype="bfloat16")
    engine = workspace_bytes(params, dtype, "gpu")
    assert engine > 0 and quantized_workspace(load_spec(tmp_path), 1.0, jnp.dtype(dtype).itemsize) == engine
