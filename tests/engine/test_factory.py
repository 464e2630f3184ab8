"""`build_engine`'s start-up order: the tokenizer loads beside the weights and the step programs, yet a missing or
broken tokenizer is still reported as such (a missing one before any weight is read)."""

from __future__ import annotations

import shutil
import threading

import pytest
from transformers import LlamaConfig

from jengine import LLM
from jengine import factory
from jengine.errors import CheckpointError
from jengine.tokenizer import Tokenizer
from jengine.tokenizer.tokenizer import TOKENIZER_FILES
from tests.conftest import COMMON


@pytest.fixture(scope="module")
def model_dir(build_checkpoint, tiny_tokenizer_dir):
    config = LlamaConfig(**{**COMMON, "num_hidden_layers": 1, "max_position_embeddings": 64})
    return build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir)[0]


def _without_tokenizer(model_dir, tmp_path):
    copy = shutil.copytree(model_dir, tmp_path / "model")
    for name in TOKENIZER_FILES:
        (copy / name).unlink(missing_ok=True)
    return copy


def test_a_missing_tokenizer_fails_before_any_weight_is_read(model_dir, tmp_path, monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the tokenizer was checked")

    monkeypatch.setattr(factory, "load_model", no_weights)
    with pytest.raises(CheckpointError, match="no tokenizer"):
        LLM(str(_without_tokenizer(model_dir, tmp_path)), dtype="float32", max_model_len=64)


def test_a_broken_tokenizer_is_reported_after_the_overlapped_load(model_dir, tmp_path):
    broken = shutil.copytree(model_dir, tmp_path / "model")
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer"):
        LLM(str(broken), dtype="float32", max_model_len=64)


def test_the_step_programs_are_built_while_the_tokenizer_loads(model_dir, monkeypatch):
    """Start-up waits for the tokenizer only once the engine core is built (its step programs included)."""
    runner_built = threading.Event()
    build_runner = factory.ModelRunner

    class LoadsOnceTheRunnerIsBuilt(Tokenizer):
        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            assert runner_built.wait(timeout=60), "start-up waited for the tokenizer before building the runner"
            return Tokenizer.from_pretrained(*args, **kwargs)

    def runner(*args, **kwargs):
        built = build_runner(*args, **kwargs)
        runner_built.set()
        return built

    monkeypatch.setattr(factory, "Tokenizer", LoadsOnceTheRunnerIsBuilt)
    monkeypatch.setattr(factory, "ModelRunner", runner)
    with LLM(str(model_dir), dtype="float32", max_model_len=64) as llm:
        assert llm.get_tokenizer().decode(llm.get_tokenizer().encode("hi"), skip_special_tokens=True).strip() == "hi"


def test_the_engine_has_the_model_directorys_tokenizer(model_dir):
    with LLM(str(model_dir), dtype="float32", max_model_len=64) as llm:
        ids = llm.get_tokenizer().encode("hello world")
        assert llm.get_tokenizer().decode(ids, skip_special_tokens=True).strip() == "hello world"


@pytest.mark.parametrize("rope, positions, limit", [
    (None, 4096, 4096),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 32768, 131072),  # Qwen recipe
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072, 131072),
    ({"type": "linear", "factor": 2.0}, 4096, 8192),
    ({"type": "dynamic", "factor": 2.0}, 4096, 4096),  # held to the positions where it equals the default rope
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, 131072, 131072),
])
def test_context_limit_follows_the_rope_scaling(rope, positions, limit):
    """As vLLM derives it: a rope scaling that exists to extend the context extends max_model_len's bound."""
    from jengine.models.registry import spec_from_hf_config

    spec = spec_from_hf_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **COMMON,
                                "max_position_embeddings": positions, "rope_scaling": rope})
    assert factory.model_context_limit(spec)[0] == limit
