"""`spec_from_hf_config` on the config.json files of real published checkpoints, spelled as they are on the Hub.

Every expected value is written by hand from what the config means (HF transformers' semantics for that family),
never computed by the code under test: head_dim, KV heads, tied embeddings, rope, per-layer attention and MLP kinds,
the sliding window, MoE routing, the checkpoint dtype and the stop tokens. (Over 400 lines because it holds eleven
published config.json files verbatim.)
"""

from __future__ import annotations

import copy

import pytest

from jengine.errors import ConfigError, UnsupportedModelError
from jengine.models.registry import SUPPORTED_ARCHITECTURES, spec_from_hf_config
from jengine.models.spec import MoeSpec

# --- config.json of published checkpoints (fields irrelevant to inference, like initializer_range, kept as shipped) ---

LLAMA_2_7B = {
    "_name_or_path": "meta-llama/Llama-2-7b-hf",
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.31.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}

LLAMA_31_8B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 128256,
}

LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}

MISTRAL_7B_INSTRUCT_V03 = {
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.0.dev0",
    "use_cache": True,
    "vocab_size": 32768,
}

QWEN25_7B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Qwen2.5-7B-Instruct as its model card says to run it past 32k tokens: YaRN, old `type` spelling.
QWEN25_7B_INSTRUCT_YARN = {
    **QWEN25_7B_INSTRUCT,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
}

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}


def _spec(config: dict):
    return spec_from_hf_config(copy.deepcopy(config))


# --- published checkpoints ---


def test_llama_2_7b():
    """MHA (32 KV heads), plain RoPE with the default base 10000 (no rope_theta in the file), float16 weights."""
    spec = _spec(LLAMA_2_7B)
    assert (spec.architecture, spec.family) == ("LlamaForCausalLM", "llama")
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (32, 4096, 32000)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 32, 128)
    assert spec.intermediate_size == 11008
    assert spec.rms_norm_eps == 1e-5
    assert spec.rope.rope_type == "default"
    assert spec.rope.theta == 10000.0
    assert spec.rope.factor == 1.0
    assert spec.max_position_embeddings == 4096
    assert spec.tie_word_embeddings is False
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias, spec.qk_norm) == (False, False, False, False)
    assert spec.attention_kinds == ("full",) * 32
    assert spec.sliding_window is None
    assert spec.layer_windows == (0,) * 32
    assert spec.mlp_kinds == ("dense",) * 32
    assert spec.moe is None
    assert spec.checkpoint_dtype == "float16"
    assert spec.bos_token_id == 1
    assert spec.eos_token_ids == (2,)


def test_llama_31_8b_instruct():
    """GQA 32/8, llama3 rope scaling (factor 8 over an original 8192 context), three stop tokens."""
    spec = _spec(LLAMA_31_8B_INSTRUCT)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 8, 128)
    assert spec.rope.rope_type == "llama3"
    assert spec.rope.theta == 500000.0
    assert spec.rope.factor == 8.0
    assert spec.rope.low_freq_factor == 1.0
    assert spec.rope.high_freq_factor == 4.0
    assert spec.rope.original_max_position_embeddings == 8192
    assert spec.rope.partial_rotary_factor == 1.0
    assert spec.max_position_embeddings == 131072
    assert spec.tie_word_embeddings is False
    assert spec.attention_kinds == ("full",) * 32
    assert spec.sliding_window is None
    assert spec.checkpoint_dtype == "bfloat16"
    assert spec.bos_token_id == 128000
    assert spec.eos_token_ids == (128001, 128008, 128009)


def test_llama_32_1b():
    """Tied embeddings; head_dim 64 given explicitly (2048 / 32 heads); llama3 rope with factor 32."""
    spec = _spec(LLAMA_32_1B)
    assert spec.tie_word_embeddings is True
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (16, 32, 8, 64)
    assert (spec.rope.rope_type, spec.rope.factor, spec.rope.theta) == ("llama3", 32.0, 500000.0)
    assert spec.rope.original_max_position_embeddings == 8192
    assert spec.eos_token_ids == (128001,)


def test_mistral_7b_v01_slides_every_layer():
    """Mistral v0.1: a 4096-token sliding window on every layer (Mistral has no per-layer rule)."""
    spec = _spec(MISTRAL_7B_V01)
    assert (spec.architecture, spec.family) == ("MistralForCausalLM", "mistral")
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 8, 128)
    assert spec.sliding_window == 4096
    assert spec.attention_kinds == ("sliding",) * 32
    assert spec.layer_windows == (4096,) * 32
    assert (spec.rope.rope_type, spec.rope.theta) == ("default", 10000.0)
    assert (spec.qkv_bias, spec.o_bias) == (False, False)
    assert spec.checkpoint_dtype == "bfloat16"
    assert spec.eos_token_ids == (2,)


def test_mistral_7b_instruct_v03_has_no_window():
    """Mistral v0.3 dropped the window (`sliding_window: null`) and raised the rope base to 1e6."""
    spec = _spec(MISTRAL_7B_INSTRUCT_V03)
    assert spec.sliding_window is None
    assert spec.attention_kinds == ("full",) * 32
    assert spec.layer_windows == (0,) * 32
    assert spec.rope.theta == 1000000.0
    assert spec.vocab_size == 32768


def test_qwen25_7b_instruct():
    """`use_sliding_window: false` wins over `sliding_window: 131072` and `max_window_layers`: all full attention.
    Qwen2 always has q/k/v biases and never an o_proj bias, though the config does not say so."""
    spec = _spec(QWEN25_7B_INSTRUCT)
    assert (spec.architecture, spec.family) == ("Qwen2ForCausalLM", "qwen2")
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (28, 4, 128)
    assert spec.sliding_window is None
    assert spec.attention_kinds == ("full",) * 28
    assert spec.layer_windows == (0,) * 28
    assert (spec.qkv_bias, spec.o_bias, spec.qk_norm) == (True, False, False)
    assert spec.tie_word_embeddings is False
    assert (spec.rope.rope_type, spec.rope.theta) == ("default", 1000000.0)
    assert spec.rms_norm_eps == 1e-6
    assert spec.eos_token_ids == (151645,)


def test_qwen25_05b_ties_embeddings():
    spec = _spec(QWEN25_05B)
    assert spec.tie_word_embeddings is True
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (14, 2, 64)
    assert spec.attention_kinds == ("full",) * 24
    assert spec.sliding_window is None
    assert (spec.qkv_bias, spec.o_bias) == (True, False)


def test_qwen25_yarn_rope_scaling():
    """YaRN written the old way (`type`, not `rope_type`), factor 4 over the original 32768 positions."""
    spec = _spec(QWEN25_7B_INSTRUCT_YARN)
    assert spec.rope.rope_type == "yarn"
    assert spec.rope.factor == 4.0
    assert spec.rope.original_max_position_embeddings == 32768
    assert spec.rope.theta == 1000000.0
    assert spec.attention_kinds == ("full",) * 28


def test_qwen3_8b():
    """Qwen3: q/k RMSNorm, no biases (attention_bias false), head_dim 128 given explicitly."""
    spec = _spec(QWEN3_8B)
    assert (spec.architecture, spec.family) == ("Qwen3ForCausalLM", "qwen3")
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (36, 32, 8, 128)
    assert spec.qk_norm is True
    assert (spec.qkv_bias, spec.o_bias) == (False, False)
    assert spec.attention_kinds == ("full",) * 36
    assert spec.sliding_window is None
    assert spec.mlp_kinds == ("dense",) * 36
    assert (spec.rope.rope_type, spec.rope.theta) == ("default", 1000000.0)
    assert spec.max_position_embeddings == 40960
    assert spec.eos_token_ids == (151645,)


def test_qwen3_30b_a3b():
    """Qwen3-MoE: every layer sparse (step 1, no mlp_only_layers), 8 of 128 experts of width 768, renormalised;
    head_dim 128 although hidden 2048 / 32 heads would give 64."""
    spec = _spec(QWEN3_30B_A3B)
    assert (spec.architecture, spec.family) == ("Qwen3MoeForCausalLM", "qwen3_moe")
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (48, 32, 4, 128)
    assert spec.qk_norm is True
    assert (spec.qkv_bias, spec.o_bias) == (False, False)
    assert spec.mlp_kinds == ("moe",) * 48
    assert spec.moe == MoeSpec(
        num_experts=128, num_experts_per_tok=8, intermediate_size=768, norm_topk_prob=True, weight_style="qwen"
    )
    assert spec.attention_kinds == ("full",) * 48
    assert spec.sliding_window is None
    assert spec.checkpoint_dtype == "bfloat16"


def test_mixtral_8x7b():
    """Mixtral: 2 of 8 local experts, each as wide as `intermediate_size`, always renormalised; no window."""
    spec = _spec(MIXTRAL_8X7B)
    assert (spec.architecture, spec.family) == ("MixtralForCausalLM", "mixtral")
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 8, 128)
    assert spec.mlp_kinds == ("moe",) * 32
    assert spec.moe == MoeSpec(
        num_experts=8, num_experts_per_tok=2, intermediate_size=14336, norm_topk_prob=True, weight_style="mixtral"
    )
    assert spec.sliding_window is None
    assert spec.attention_kinds == ("full",) * 32
    assert spec.rope.theta == 1000000.0


# --- per-layer rules ---


def test_qwen3_moe_dense_layers_from_mlp_only_layers_and_sparse_step():
    """A layer is sparse unless listed in mlp_only_layers, and only when (index + 1) is a multiple of the step."""
    config = {**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    spec = _spec(config)
    # layer:              0        1      2        3 (listed)  4        5
    assert spec.mlp_kinds == ("dense", "moe", "dense", "dense", "dense", "moe")


def test_qwen2_max_window_layers_when_sliding_is_on():
    """Qwen2 checkpoint spelling: with use_sliding_window true, layers from max_window_layers on slide."""
    config = {**QWEN25_05B, "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 1024,
              "max_window_layers": 1}
    spec = _spec(config)
    assert spec.attention_kinds == ("full", "sliding", "sliding", "sliding")
    assert spec.layer_windows == (0, 1024, 1024, 1024)


def test_layer_types_list_sets_sliding_layers():
    """A transformers-5 `layer_types` list decides per layer, even in a pattern max_window_layers cannot express."""
    config = {**QWEN3_8B, "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 512,
              "max_window_layers": 4,
              "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}
    spec = _spec(config)
    assert spec.attention_kinds == ("sliding", "full", "sliding", "full")
    assert spec.sliding_window == 512
    assert spec.layer_windows == (512, 0, 512, 0)


def test_layer_types_with_wrong_length_is_refused():
    config = {**QWEN3_8B, "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 512,
              "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        _spec(config)


# --- the two spellings ---


def _transformers5_spelling(config: dict) -> dict:
    """How transformers 5 `save_pretrained` writes the same model: one `rope_parameters` dict with `rope_type` and
    `rope_theta`, no top-level `rope_theta`/`rope_scaling`, and `dtype` for `torch_dtype` (written by hand)."""
    out = copy.deepcopy(config)
    scaling = out.pop("rope_scaling", None) or {}
    rope = {"rope_theta": out.pop("rope_theta", 10000.0)}
    rope["rope_type"] = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    rope.update(scaling)
    out["rope_parameters"] = rope
    out["dtype"] = out.pop("torch_dtype")
    return out


def test_transformers5_spelling_of_llama_31_by_hand():
    config = {
        **{k: v for k, v in LLAMA_31_8B_INSTRUCT.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")},
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "dtype": "bfloat16",
    }
    assert spec_from_hf_config(config) == _spec(LLAMA_31_8B_INSTRUCT)


@pytest.mark.parametrize(
    "config",
    [LLAMA_2_7B, LLAMA_31_8B_INSTRUCT, MISTRAL_7B_INSTRUCT_V03, QWEN25_7B_INSTRUCT_YARN, QWEN3_30B_A3B, MIXTRAL_8X7B],
    ids=["llama2", "llama31", "mistral-v03", "qwen25-yarn", "qwen3-moe", "mixtral"],
)
def test_transformers5_spelling_gives_the_same_spec(config):
    t5 = _transformers5_spelling(config)
    assert "rope_scaling" not in t5 and "rope_theta" not in t5 and "torch_dtype" not in t5
    assert spec_from_hf_config(t5) == _spec(config)


def test_transformers5_config_written_by_transformers():
    """The real transformers-5 `to_dict()` of Llama 3.1's settings parses to the checkpoint-spelled spec."""
    from transformers import LlamaConfig

    fields = {k: v for k, v in LLAMA_31_8B_INSTRUCT.items()
              if k not in ("architectures", "rope_scaling", "rope_theta", "torch_dtype", "transformers_version",
                           "model_type")}
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA_31_8B_INSTRUCT["rope_scaling"]}
    config = LlamaConfig(**fields, rope_parameters=rope, architectures=["LlamaForCausalLM"], dtype="bfloat16")
    as_saved = config.to_dict()
    assert "rope_parameters" in as_saved
    assert spec_from_hf_config(as_saved) == _spec(LLAMA_31_8B_INSTRUCT)


# --- refusals ---


@pytest.mark.parametrize("rope_type", ["longrope", "mrope"])
@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_unsupported_rope_type_is_named(rope_type, key):
    config = {**LLAMA_2_7B, "rope_scaling": {key: rope_type, "factor": 2.0}}
    with pytest.raises(UnsupportedModelError, match=rope_type):
        _spec(config)


def test_unsupported_rope_type_in_rope_parameters_is_named():
    config = _transformers5_spelling(LLAMA_2_7B)
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match="longrope"):
        spec_from_hf_config(config)


def test_unknown_architecture_lists_the_supported_ones():
    config = {**LLAMA_2_7B, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(UnsupportedModelError) as info:
        _spec(config)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    for architecture in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                         "MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        assert architecture in SUPPORTED_ARCHITECTURES
        assert architecture in message


def test_missing_architectures_is_refused():
    config = {k: v for k, v in LLAMA_2_7B.items() if k != "architectures"}
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        _spec(config)


def test_heads_not_divisible_by_kv_heads_is_refused():
    config = {**LLAMA_31_8B_INSTRUCT, "num_key_value_heads": 6}
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads"):
        _spec(config)


def test_unsupported_hidden_act_is_refused():
    config = {**LLAMA_2_7B, "hidden_act": "sigmoid"}
    with pytest.raises(UnsupportedModelError, match="sigmoid"):
        _spec(config)


def test_missing_required_field_is_named():
    config = {k: v for k, v in QWEN3_30B_A3B.items() if k != "moe_intermediate_size"}
    with pytest.raises(UnsupportedModelError, match="moe_intermediate_size"):
        _spec(config)


def test_moe_fields_left_out_take_hf_defaults_and_top_k_is_checked():
    """Where a MoE config.json leaves a field out, HF's config class's default (Mixtral's rope theta 1e6, Qwen2-MoE's
    5632-wide shared expert, the expert counts), not a silent other value; a top-k outside 1..experts is refused."""
    mixtral = _spec({k: v for k, v in MIXTRAL_8X7B.items() if k not in ("rope_theta", "num_local_experts")})
    assert mixtral.rope.theta == 1e6 and mixtral.moe.num_experts == 8
    scaled = {k: v for k, v in MIXTRAL_8X7B.items() if k != "rope_theta"} | {
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}}  # scaling given, its theta not
    assert _spec(scaled).rope.theta == 1e6
    assert _spec(scaled | {"rope_parameters": {"rope_theta": 5e5}}).rope.theta == 5e5
    qwen3 = _spec({k: v for k, v in QWEN3_30B_A3B.items() if k not in ("num_experts", "num_experts_per_tok")})
    assert (qwen3.moe.num_experts, qwen3.moe.num_experts_per_tok) == (128, 8)
    qwen2 = {**QWEN3_30B_A3B, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}
    assert _spec(qwen2).moe.shared_intermediate_size == 5632
    for k in (0, 129):
        with pytest.raises(UnsupportedModelError, match=f"num_experts_per_tok={k} must be between 1 and"):
            _spec({**QWEN3_30B_A3B, "num_experts_per_tok": k})
    with pytest.raises(UnsupportedModelError, match="use_sliding_window and no layer_types"):
        _spec({**qwen2, "use_sliding_window": True, "sliding_window": 4096})


def test_refusals_are_config_errors():
    """Start-up code catches ConfigError for every configuration problem, unsupported models included."""
    assert issubclass(UnsupportedModelError, ConfigError)
