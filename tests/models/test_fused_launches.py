"""Launches fused in the batch-invariant mode change no bit: the decoder's residual adds run inside the norms after
them (`layers/norm.py:add_rms_norm`), and Qwen3's query and key norms run as one launch (`rms_norm_pair`). With the
batch-invariant norms as Pallas kernels (interpret mode, as on a GPU) the step's logits and the captured layer
inputs (EAGLE-3's features) are bit for bit those of the unfused path (the add, then the norm kernel; each norm
alone): dense, MoE (with query and key norms) and shared-expert layers, in bfloat16 and float32."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from transformers import LlamaConfig, Qwen2MoeConfig, Qwen3MoeConfig

from jengine.attention.backend import ReferenceBackend
from jengine.attention.metadata import build_metadata
from jengine.layers import attention, norm
from jengine.layers.attention import allocate_kv_cache
from jengine.layers.invariant import make_invariant
from jengine.layers.norm import rms_norm
from jengine.models import decoder
from jengine.models.loader import load_model
from jengine.runner.step import ModelInputs, StepModel, StepState, forward_step
from tests.conftest import COMMON, fresh_seed

SEED = fresh_seed()
BLOCK = 4
CAPTURE = (0, 2)  # layer 2's input is captured: the pending MLP output is added before it, outside the norm


def unfused_add_rms_norm(x, delta, weight, eps):
    total = x + delta
    return total, rms_norm(total, weight, eps)


real_pair = norm.invariant_rms_norm_pair


def separate_rms_norms(a, b, weight_a, weight_b, eps):
    return rms_norm(a, weight_a, eps), rms_norm(b, weight_b, eps)


@pytest.fixture
def fresh_traces():
    """The step and the layer retrace: a patched function must neither meet a cached trace nor leave one."""
    for jitted in (forward_step, decoder._decoder_layer):
        jitted.clear_cache()
    yield
    for jitted in (forward_step, decoder._decoder_layer):
        jitted.clear_cache()


def prefill(model_dir, dtype: str):
    """One prefill step of three ragged prompts: (logits at every position, the captured layer inputs)."""
    spec, params, dt = load_model(model_dir, dtype=dtype, progress=False)
    params = make_invariant(params, "pallas_interpret", spec.tie_word_embeddings)
    rng = np.random.default_rng(SEED)
    lens = [5, 11, 2]
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(len(lens))]
    md = build_metadata(lens, lens, tables, block_size=BLOCK, num_slots=12 * BLOCK)
    tokens = rng.integers(3, COMMON["vocab_size"], size=sum(lens)).astype(np.int32)
    inputs = ModelInputs(tokens, md, np.arange(sum(lens)), None, None)
    state = StepState(allocate_kv_cache(spec, 12, BLOCK, dt), None)
    logits, _, _, features = forward_step(StepModel(spec, ReferenceBackend(), capture=CAPTURE), params, state, inputs)
    return np.asarray(logits), np.asarray(features.astype(jnp.float32))


@pytest.mark.parametrize("config,dtype", [
    (LlamaConfig(**COMMON), "bfloat16"),
    (LlamaConfig(**COMMON), "float32"),
    (Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
     "bfloat16"),
    (Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                    shared_expert_intermediate_size=48, mlp_only_layers=[1]), "bfloat16"),
], ids=["llama-bf16", "llama-f32", "qwen3-moe-bf16", "qwen2-moe-shared-bf16"])
def test_fused_launches_change_no_bit(build_checkpoint, fresh_traces, monkeypatch, config, dtype):
    model_dir, _ = build_checkpoint(config)
    pairs = []
    monkeypatch.setattr(norm, "invariant_rms_norm_pair", lambda *a: pairs.append(1) or real_pair(*a))
    fused_logits, fused_features = prefill(model_dir, dtype)
    assert bool(pairs) == (config.model_type == "qwen3_moe")  # traced once per distinct layer trace, not per layer
    monkeypatch.setattr(decoder, "add_rms_norm", unfused_add_rms_norm)
    monkeypatch.setattr(attention, "rms_norm_pair", separate_rms_norms)
    for jitted in (forward_step, decoder._decoder_layer):
        jitted.clear_cache()
    logits, features = prefill(model_dir, dtype)
    assert np.array_equal(fused_logits.view(np.uint32), logits.view(np.uint32)), f"seed {SEED}"
    assert np.array_equal(fused_features.view(np.uint32), features.view(np.uint32)), f"seed {SEED}"
