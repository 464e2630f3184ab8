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


# ---------------------------------------------------------------------------------------------- EAGLE heads
def _head_config(architecture: str, **extra) -> dict:
    """A head's config.json: the target's layer shape, one layer (as published heads write it)."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "bos_token_id", "eos_token_id")
    return {"architectures": [architecture], **{k: COMMON[k] for k in keys}, "num_hidden_layers": 1,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": "float32", **extra}


def _layer_tensors(prefix: str, rng: np.random.Generator, attention_input: int, num_experts: int = 0,
                   scale: float = 0.08) -> dict[str, np.ndarray]:
    """One Llama (or Mixtral, with experts) decoder layer's tensors in HF names, [out, in] projections."""
    d, inter = COMMON["hidden_size"], COMMON["intermediate_size"]
    kv = COMMON["num_key_value_heads"] * d // COMMON["num_attention_heads"]

    def w(*shape):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = {f"{prefix}.self_attn.q_proj.weight": w(d, attention_input),
               f"{prefix}.self_attn.k_proj.weight": w(kv, attention_input),
               f"{prefix}.self_attn.v_proj.weight": w(kv, attention_input),
               f"{prefix}.self_attn.o_proj.weight": w(d, d),
               f"{prefix}.post_attention_layernorm.weight": 1 + w(d)}
    if num_experts:
        moe = f"{prefix}.block_sparse_moe"
        tensors[f"{moe}.gate.weight"] = w(num_experts, d)
        for e in range(num_experts):
            tensors |= {f"{moe}.experts.{e}.w1.weight": w(inter, d), f"{moe}.experts.{e}.w3.weight": w(inter, d),
                        f"{moe}.experts.{e}.w2.weight": w(d, inter)}
    else:
        tensors |= {f"{prefix}.mlp.gate_proj.weight": w(inter, d), f"{prefix}.mlp.up_proj.weight": w(inter, d),
                    f"{prefix}.mlp.down_proj.weight": w(d, inter)}
    return tensors


def write_head(out, config: dict, tensors: dict[str, np.ndarray]):
    import json

    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def build_eagle_head(out, seed: int, moe_layer: bool = False, scale: float = 0.08):
    """An EAGLE(-2) head as yuhuili/EAGLE-LLaMA3-Instruct-8B lays it out: fc over concat(embedding, feature), one
    decoder layer without input_layernorm, the target's embedding and LM head reused. `moe_layer`: the layer is a
    Mixtral one (a head for a Mixtral target)."""
    rng = np.random.default_rng(seed)
    d = COMMON["hidden_size"]
    experts = 4 if moe_layer else 0
    architecture = "MixtralForCausalLM" if moe_layer else "LlamaForCausalLM"
    extra = {"num_local_experts": experts, "num_experts_per_tok": 2} if moe_layer else {}
    tensors = {"fc.weight": (rng.standard_normal((d, 2 * d)) * 0.08).astype(np.float32),
               **_layer_tensors("layers.0", rng, d, experts, scale)}
    return write_head(out, _head_config(architecture, **extra), tensors)


DRAFT_VOCAB = 128


def build_eagle3_head(out, seed: int, aux_layers: list[int] | None = None, scale: float = 0.08):
    """An EAGLE-3 head in the published layout: fc fusing three target layers, a `midlayer` whose q/k/v read
    (embedding ‖ feature), its own norm and an LM head over a reduced vocabulary mapped by d2t / t2d."""
    rng = np.random.default_rng(seed)
    d, vocab = COMMON["hidden_size"], COMMON["vocab_size"]
    draft_ids = np.sort(rng.choice(vocab, DRAFT_VOCAB, replace=False))
    t2d = np.zeros(vocab, bool)
    t2d[draft_ids] = True
    tensors = {"fc.weight": (rng.standard_normal((d, 3 * d)) * 0.08).astype(np.float32),
               **_layer_tensors("midlayer", rng, 2 * d, scale=scale),
               "midlayer.input_layernorm.weight": np.ones(d, np.float32),
               "midlayer.hidden_norm.weight": np.ones(d, np.float32),
               "norm.weight": np.ones(d, np.float32),
               "lm_head.weight": (rng.standard_normal((DRAFT_VOCAB, d)) * 0.08).astype(np.float32),
               "d2t": draft_ids - np.arange(DRAFT_VOCAB), "t2d": t2d}
    extra = {"draft_vocab_size": DRAFT_VOCAB}
    if aux_layers is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers, "use_aux_hidden_state": True}
    return write_head(out, _head_config("LlamaForCausalLMEagle3", **extra), tensors)


@pytest.fixture(scope="session")
def eagle_heads(tmp_path_factory) -> dict[str, object]:
    """Random heads by (method, target family): the MoE target's EAGLE head has a Mixtral layer."""
    root = tmp_path_factory.mktemp("eagle_heads")
    return {("eagle", "dense"): build_eagle_head(root / "eagle_dense", seed=3),
            ("eagle", "moe"): build_eagle_head(root / "eagle_moe", seed=4, moe_layer=True),
            ("eagle3", "dense"): build_eagle3_head(root / "eagle3_dense", seed=5),
            ("eagle3", "moe"): build_eagle3_head(root / "eagle3_moe", seed=6, aux_layers=[0, 1, 2])}
