"""The benchmark's MoE model directories (scripts/moe_shapes.py): the published shapes, parameter counts of the real
models, loadable by HF transformers' config classes and servable with `load_format="dummy"`."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from transformers import AutoConfig, MixtralConfig, Qwen3MoeConfig

from jengine import LLM, SamplingParams
from jengine.models.loader import load_spec
from jengine.models.weights import is_source, parameter_sources

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from moe_shapes import write_shape  # noqa: E402


def num_params(model_dir: Path) -> int:
    sources = parameter_sources(load_spec(model_dir))
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(sources, is_leaf=is_source))


@pytest.mark.parametrize("name, config_class, params, layers, experts, k", [
    ("qwen3-30b-a3b", Qwen3MoeConfig, 30.53e9, 48, 128, 8),  # Qwen3-30B-A3B: 30.5B parameters
    ("mixtral-8x7b", MixtralConfig, 46.70e9, 32, 8, 2),  # Mixtral-8x7B: 46.7B parameters
])
def test_shapes_are_the_published_models(name, config_class, params, layers, experts, k, tmp_path):
    model_dir = write_shape(name, tmp_path)
    spec = load_spec(model_dir)
    assert (spec.num_layers, spec.moe.num_experts, spec.moe.num_experts_per_tok) == (layers, experts, k)
    assert set(spec.mlp_kinds) == {"moe"}
    assert abs(num_params(model_dir) / params - 1) < 0.005
    assert isinstance(AutoConfig.from_pretrained(model_dir), config_class)
    assert load_spec(write_shape(name, tmp_path / "short", num_layers=12)).num_layers == 12


def test_a_written_directory_serves_with_dummy_weights(tmp_path):
    """The directory as the benchmark uses it (the shape narrowed here so a CPU runs it)."""
    small = dict(vocab_size=2048, hidden_size=64, moe_intermediate_size=32, num_experts=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    model_dir = write_shape("qwen3-30b-a3b", tmp_path, num_layers=2, **small)
    with LLM(str(model_dir), load_format="dummy", max_model_len=64) as llm:
        out = llm.chat([[{"role": "user", "content": "Hello"}]], SamplingParams(max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
