"""Our logits and greedy continuations equal HF transformers' on the same weights, for every supported family.

Each test runs a ragged batch of prompts of different lengths through the paged KV layout (one prefill step, then
one-token decode steps, pages scattered over the pool) and compares against the HF model on the same tokens:
float32 logits within 1e-4 · max|ref| at every prompt position and every decode step, chosen-token logprobs within
1e-3, 32-token greedy continuations identical to `generate`. bfloat16 prefill logits are compared with the float32
reference: within 2e-2 · max|ref| at every position for dense models; for MoE models at 90 % of the positions, because
bfloat16 noise flips near-tied expert choices at a few tokens (HF's own bfloat16 forward lands up to 3.9e-2 away from
its float32 one on these models).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from transformers import (LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                          Qwen3MoeConfig)

from jengine.models.loader import load_model
from jengine.runner.simple import SimpleGenerator
from tests.conftest import COMMON

TEXTS = [
    "The quick brown fox jumps over the lazy dog, again and again.",
    "你好，世界 🙂",
    "Bonjour à tous! 日本語のテキスト and some more English words to make this prompt the longest one by far 🚀👍🏽",
]
NEW_TOKENS = 32
F32_TOL, LOGPROB_TOL, BF16_TOL = 1e-4, 1e-3, 2e-2
MOE_BF16_POSITIONS = 0.9  # fraction of positions that must be within BF16_TOL for MoE models


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer_dir) -> list[list[int]]:
    tok = HFTokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    ids = [tok.encode(t).ids for t in TEXTS]
    assert len({len(p) for p in ids}) == len(ids), "prompts must differ in length"
    return ids


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _hf_logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def check_parity(
    model_dir, hf_model, prompts: list[list[int]], block_size: int = 4, bf16_positions: float = 1.0
) -> None:
    spec, params, dtype = load_model(model_dir, dtype="float32", progress=False)
    result = SimpleGenerator(spec, params, dtype, block_size=block_size).generate(
        prompts, NEW_TOKENS, return_prompt_logits=True, shuffle_blocks_seed=1
    )
    for b, prompt in enumerate(prompts):
        generated = result.token_ids[b]
        ours = np.concatenate([result.prompt_logits[b]] + [step[b][None] for step in result.step_logits[1:]])
        ref = _hf_logits(hf_model, prompt + generated[:-1])
        assert ours.shape == ref.shape
        scale = np.abs(ref).max()
        assert np.abs(ours - ref).max() <= F32_TOL * scale, f"prompt {b}: logits differ"
        chosen = np.array(generated)
        rows = np.arange(len(prompt) - 1, len(prompt) - 1 + NEW_TOKENS)
        ours_lp = _log_softmax(ours[rows])[np.arange(NEW_TOKENS), chosen]
        ref_lp = _log_softmax(ref[rows])[np.arange(NEW_TOKENS), chosen]
        assert np.abs(ours_lp - ref_lp).max() <= LOGPROB_TOL
        # HF's greedy choice at every generated position (teacher-forced on the same prefix: equal step by step to
        # HF `generate` while the tokens agree, and EOS stays a candidate as it does for our argmax)
        hf_greedy = ref[rows].argmax(-1).tolist()
        assert generated == hf_greedy, f"prompt {b}: greedy continuation differs"
    check_bf16_parity(model_dir, hf_model, prompts, block_size, bf16_positions)


def check_bf16_parity(model_dir, hf_model, prompts: list[list[int]], block_size: int, positions: float) -> None:
    spec, params, dtype = load_model(model_dir, dtype="bfloat16", progress=False)
    result = SimpleGenerator(spec, params, dtype, block_size=block_size).generate(
        prompts, 1, return_prompt_logits=True
    )
    for b, prompt in enumerate(prompts):
        ref = _hf_logits(hf_model, prompt)
        per_position = np.abs(result.prompt_logits[b] - ref).max(axis=-1) / np.abs(ref).max()
        assert np.mean(per_position <= BF16_TOL) >= positions, f"prompt {b}: bfloat16 logits differ"


def test_parity_llama(build_checkpoint, prompts):
    """Llama 3.1: llama3 rope scaling in the checkpoint spelling, an explicit head_dim ≠ hidden/heads."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    config = LlamaConfig(**COMMON, head_dim=24, rope_parameters=rope)
    model_dir, model = build_checkpoint(config, spelling="checkpoint")
    check_parity(model_dir, model, prompts)


def test_parity_llama_tied_embeddings(build_checkpoint, prompts):
    """Llama 3.2: tied input/output embeddings (no lm_head tensor), attention and MLP biases, MHA."""
    config = LlamaConfig(**{**COMMON, "num_key_value_heads": 4}, tie_word_embeddings=True, attention_bias=True,
                         mlp_bias=True)
    model_dir, model = build_checkpoint(config)
    check_parity(model_dir, model, prompts, block_size=16)


def test_parity_mistral(build_checkpoint, prompts):
    """Mistral: a sliding window (5) shorter than every prompt; a sharded save with an index."""
    config = MistralConfig(**COMMON, sliding_window=5, head_dim=16)
    model_dir, model = build_checkpoint(config, shard=True)
    assert (model_dir / "model.safetensors.index.json").exists()
    check_parity(model_dir, model, prompts)


def test_parity_qwen2(build_checkpoint, prompts):
    """Qwen2.5: q/k/v biases, tied embeddings, sliding window on the layers from `max_window_layers` on."""
    config = Qwen2Config(**COMMON, tie_word_embeddings=True, use_sliding_window=True, sliding_window=6,
                         max_window_layers=1)
    model_dir, model = build_checkpoint(config, spelling="checkpoint")
    check_parity(model_dir, model, prompts)


def test_parity_qwen3(build_checkpoint, prompts):
    """Qwen3: q/k RMSNorm, explicit head_dim, YaRN rope scaling."""
    rope = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    config = Qwen3Config(**COMMON, head_dim=32, rope_parameters=rope)
    model_dir, model = build_checkpoint(config)
    check_parity(model_dir, model, prompts)


def test_parity_yarn_past_max_position_embeddings(build_checkpoint, prompts):
    """Qwen's long-context recipe: YaRN over an original 32 positions × 4, with the prompts and their continuations
    running well past max_position_embeddings=32 (jengine's context bound becomes 128, as vLLM's)."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    config = Qwen2Config(**{**COMMON, "max_position_embeddings": 32}, rope_parameters=rope)
    assert max(len(p) for p in prompts) + NEW_TOKENS > 32
    model_dir, model = build_checkpoint(config)
    check_parity(model_dir, model, prompts)


def test_parity_dynamic_rope(build_checkpoint, prompts):
    """Dynamic NTK scaling (older Llama fine-tunes) is the default rope within max_position_embeddings."""
    config = LlamaConfig(**COMMON, rope_scaling={"type": "dynamic", "factor": 2.0})
    model_dir, model = build_checkpoint(config, spelling="checkpoint")
    check_parity(model_dir, model, prompts)


def test_parity_mixtral(build_checkpoint, prompts):
    """Mixtral: top-2 of 4 experts with renormalised weights, sliding window."""
    config = MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=7)
    model_dir, model = build_checkpoint(config, spelling="checkpoint")
    check_parity(model_dir, model, prompts, bf16_positions=MOE_BF16_POSITIONS)


@pytest.mark.parametrize("norm_topk_prob, sparse_step", [(True, 1), (False, 2)])
def test_parity_qwen3_moe(build_checkpoint, prompts, norm_topk_prob, sparse_step):
    """Qwen3-MoE: dense layers from `mlp_only_layers` and `decoder_sparse_step`, both routing normalisations."""
    config = Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 4}, moe_intermediate_size=32, num_experts=8,
                            num_experts_per_tok=3, mlp_only_layers=[0], decoder_sparse_step=sparse_step,
                            norm_topk_prob=norm_topk_prob)
    model_dir, model = build_checkpoint(config)
    check_parity(model_dir, model, prompts, bf16_positions=MOE_BF16_POSITIONS)


def test_parity_qwen2_moe(build_checkpoint, prompts):
    """Qwen1.5-MoE / Qwen2-MoE: q/k/v biases, routed experts without renormalisation beside the sigmoid-gated shared
    expert (a width of its own), a dense layer from `mlp_only_layers`."""
    config = Qwen2MoeConfig(**{**COMMON, "num_hidden_layers": 3}, moe_intermediate_size=32, num_experts=8,
                            num_experts_per_tok=3, shared_expert_intermediate_size=48, mlp_only_layers=[1],
                            norm_topk_prob=False)
    model_dir, model = build_checkpoint(config)
    check_parity(model_dir, model, prompts, bf16_positions=MOE_BF16_POSITIONS)
