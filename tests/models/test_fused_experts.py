"""MoE checkpoints saved by transformers 5 with fused expert stacks (`mlp.experts.gate_up_proj`, `down_proj`) load
as the same model saved per expert: HF's logits within the parity tolerance (1e-4 · max|ref|, float32)."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from jengine.errors import CheckpointError
from jengine.models.loader import load_model
from jengine.runner.simple import SimpleGenerator
from tests.conftest import COMMON

PROMPTS = [[5, 9, 33, 70, 2, 11, 40], [7, 100, 3]]
MOE = dict(num_experts_per_tok=2)
CONFIGS = {
    "qwen3_moe": Qwen3MoeConfig(**COMMON, **MOE, num_experts=4, moe_intermediate_size=48, norm_topk_prob=True),
    "qwen2_moe": Qwen2MoeConfig(**COMMON, **MOE, num_experts=4, moe_intermediate_size=48,
                                shared_expert_intermediate_size=64),
    "mixtral": MixtralConfig(**COMMON, **MOE, num_local_experts=4),
}


def _saved_fused(config, directory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    model.save_pretrained(directory, save_original_format=False)
    with safe_open(str(directory / "model.safetensors"), "np") as f:
        names = list(f.keys())
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in names)  # the stacks really are fused
    return model


@pytest.mark.parametrize("family", CONFIGS)
def test_fused_expert_stacks_load_as_per_expert_weights(tmp_path, family):
    model = _saved_fused(CONFIGS[family], tmp_path)
    spec, params, dtype = load_model(tmp_path, dtype="float32", progress=False)
    ours = SimpleGenerator(spec, params, dtype, block_size=4).generate(PROMPTS, 1, return_prompt_logits=True)
    for prompt, logits in zip(PROMPTS, ours.prompt_logits, strict=True):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].numpy()
        assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()


def test_a_transposed_stack_is_refused_by_name(tmp_path):
    from safetensors.numpy import load_file, save_file

    _saved_fused(CONFIGS["qwen3_moe"], tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[name] = np.ascontiguousarray(tensors[name].transpose(0, 2, 1))  # [E, H, 2I], as some models store it
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"gate_up_proj has shape \(4, 64, 96\); expert stacks are read as"):
        load_model(tmp_path, dtype="float32", progress=False)
