"""A tiny Llama and PEFT adapters on it (random A and B, so every adapter changes the output), with each adapter's
reference model: the base with that adapter merged by `peft`'s `merge_and_unload`."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from tests.conftest import COMMON

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def lora_base(build_checkpoint, tiny_tokenizer_dir):
    config = LlamaConfig(**{**COMMON, "max_position_embeddings": 256})
    return build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir, seed=3)


@pytest.fixture(scope="session")
def make_adapter(lora_base, tmp_path_factory) -> Callable:
    """make_adapter(rank, modules=ALL_MODULES, alpha=None, rslora=False, seed=0, **extra) -> (dir, merged HF model)."""
    from peft import LoraConfig, get_peft_model

    _, base = lora_base

    def make(rank: int, modules=tuple(ALL_MODULES), alpha: float | None = None, rslora: bool = False,
             seed: int = 0, **extra) -> tuple[Path, torch.nn.Module]:
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(modules),
                            use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0, **extra)
        model = get_peft_model(copy.deepcopy(base), config)
        with torch.no_grad():  # random weights of a size that moves greedy choices without swamping the base
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn_like(param) * 0.15)
        out = tmp_path_factory.mktemp(f"adapter-r{rank}")
        model.save_pretrained(out)
        merged = model.merge_and_unload()
        merged.eval()
        return out, merged

    return make
