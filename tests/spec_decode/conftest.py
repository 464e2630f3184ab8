"""Tiny checkpoints for speculative decoding: dense and MoE targets, a smaller draft with the same vocabulary, and a
"copying" model whose greedy continuation repeats its prompt (the n-gram proposer's best case)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, MixtralConfig

from tests.conftest import COMMON

COPY_CYCLE = 10  # the copying model maps each token of a 10-token cycle to the next one


@pytest.fixture(scope="session")
def dense_target(build_checkpoint, tiny_tokenizer_dir):
    return build_checkpoint(LlamaConfig(**{**COMMON, "max_position_embeddings": 256}),
                            tokenizer_dir=tiny_tokenizer_dir)[0]


@pytest.fixture(scope="session")
def moe_target(build_checkpoint, tiny_tokenizer_dir):
    config = MixtralConfig(**{**COMMON, "max_position_embeddings": 256}, num_local_experts=4, num_experts_per_tok=2)
    return build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir)[0]


@pytest.fixture(scope="session")
def small_draft(build_checkpoint):
    config = LlamaConfig(**{**COMMON, "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 48,
                            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256})
    return build_checkpoint(config, seed=1)[0]


@pytest.fixture(scope="session")
def copying_model(tmp_path_factory, tiny_tokenizer_dir):
    """A Llama whose layers add nothing (o_proj and down_proj are zero) and whose LM head maps each token to the
    next of one cycle: the greedy continuation of the cycle repeated is the cycle again. Returns (dir, cycle)."""
    import shutil

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(**{**COMMON, "max_position_embeddings": 256, "tie_word_embeddings": False}),
        attn_implementation="eager", dtype=torch.float32)
    vocab = COMMON["vocab_size"]
    cycle = np.random.default_rng(0).choice(np.arange(3, vocab), COPY_CYCLE, replace=False)
    successor = np.arange(vocab)
    successor[cycle] = np.roll(cycle, -1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        model.lm_head.weight[torch.as_tensor(successor)] = embed.clone()
    out = tmp_path_factory.mktemp("copying")
    model.save_pretrained(out)
    for item in tiny_tokenizer_dir.iterdir():
        shutil.copy(item, out / item.name)
    return out, cycle.tolist()
