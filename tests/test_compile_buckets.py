"""`compile_buckets="all"`: every step shape is compiled at start-up, so serving compiles nothing afterwards."""

from __future__ import annotations

import logging

import pytest
from transformers import LlamaConfig

from jengine import LLM, SamplingParams
from jengine.runner.step import num_compiled_shapes
from tests.conftest import COMMON


@pytest.fixture(scope="module")
def model_dir(build_checkpoint, tiny_tokenizer_dir):
    config = LlamaConfig(**{**COMMON, "num_hidden_layers": 1, "max_position_embeddings": 64})
    return build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir)[0]


def test_all_buckets_compile_at_start_and_steady_state_compiles_nothing(model_dir, caplog):
    with LLM(str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
             compile_buckets="all") as llm:
        after_start = num_compiled_shapes()
        prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 5, 17, 40, 9, 30, 2, 12, 33)]
        for params in (SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0.7, max_tokens=6)):
            with caplog.at_level(logging.WARNING, logger="jengine.runner.compile"):
                outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
        assert num_compiled_shapes() == after_start, "a step compiled after warm-up"
        assert "compiled after warm-up" not in caplog.text


def test_auto_compiles_up_front_only_with_a_kernel_backend(model_dir):
    """`auto` (the server default) pins and precompiles with a kernel backend; with the jnp reference (the CPU) it
    compiles lazily, so a CPU server starts in seconds."""
    before = num_compiled_shapes()
    with LLM(str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
             compile_buckets="auto") as llm:
        assert llm._core.runner.backend.name == "reference"
        assert not llm._core.runner.batch.pin_shapes
        assert num_compiled_shapes() == before
