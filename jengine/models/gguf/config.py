"""A GGUF file's metadata → the HF `config.json` dict the registry reads (`models/registry.py`).

Keys are llama.cpp's: `general.architecture` names the family, and `<arch>.block_count`, `<arch>.embedding_length`,
`<arch>.attention.head_count`, ... its hyper-parameters. The MoE variants are `qwen3moe`, `qwen2moe` (routed experts
beside a gated shared one) and `llama` with `<arch>.expert_count` (Mixtral's files). Other architectures are refused
by name. The end-of-generation tokens are llama.cpp's: `eos`, and `eot` / `eom` where the file names them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jengine.errors import UnsupportedModelError

# GGUF architecture → (HF architecture, model_type); llama with experts is Mixtral
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
}
_STOP_TOKENS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
MIXTRAL = ("MixtralForCausalLM", "mixtral")


def _required(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise UnsupportedModelError(f"the GGUF file has no metadata key {key!r}")
    return metadata[key]


def hf_config(metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """`tensor_shapes`: GGUF tensor name → numpy shape (the vocabulary size and the tied head are read from them)."""
    arch = _required(metadata, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; supported: "
                                    f"{', '.join(ARCHITECTURES)} (and llama with experts, i.e. Mixtral)")
    key = f"{arch}.".__add__
    experts = int(metadata.get(key("expert_count"), 0) or 0)
    architecture, model_type = MIXTRAL if arch == "llama" and experts else ARCHITECTURES[arch]
    heads = int(_required(metadata, key("attention.head_count")))
    hidden = int(_required(metadata, key("embedding_length")))
    config: dict[str, Any] = {
        "architectures": [architecture], "model_type": model_type,
        "vocab_size": int(_required(tensor_shapes, "token_embd.weight")[0]),
        "hidden_size": hidden,
        "intermediate_size": int(metadata.get(key("feed_forward_length"), 0) or 0),
        "num_hidden_layers": int(_required(metadata, key("block_count"))),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get(key("attention.head_count_kv"), heads)),
        "head_dim": int(metadata.get(key("attention.key_length"), hidden // heads)),
        "rms_norm_eps": float(metadata.get(key("attention.layer_norm_rms_epsilon"), 1e-6)),
        "rope_theta": float(metadata.get(key("rope.freq_base"), 10000.0)),
        "max_position_embeddings": int(metadata.get(key("context_length"), 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_shapes and arch == "llama",
        "torch_dtype": "bfloat16",
    }
    if "tokenizer.ggml.bos_token_id" in metadata:
        config["bos_token_id"] = int(metadata["tokenizer.ggml.bos_token_id"])
    stops = list(dict.fromkeys(int(metadata[k]) for k in _STOP_TOKENS if k in metadata))
    if stops:  # e.g. Llama-3-Instruct files: eos <|end_of_text|>, eot <|eot_id|>
        config["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    config.update(_rope_scaling(metadata, key))
    if experts:
        config.update(_moe_fields(metadata, key, experts, arch))
    return config


def _moe_fields(metadata: dict[str, Any], key, experts: int, arch: str) -> dict[str, Any]:
    fields = {"num_experts_per_tok": int(_required(metadata, key("expert_used_count")))}
    if arch == "llama":
        return fields | {"num_local_experts": experts}
    if arch != "qwen2moe" and int(metadata.get(key("expert_shared_count"), 0) or 0):
        raise UnsupportedModelError(f"GGUF {arch} files with shared experts are not supported")
    fields |= {"num_experts": experts, "decoder_sparse_step": 1, "mlp_only_layers": [],
               "moe_intermediate_size": int(_required(metadata, key("expert_feed_forward_length")))}
    if arch == "qwen2moe":  # llama.cpp: top-k weights as the softmax gave them, the shared expert's width or the FFN's
        shared = metadata.get(key("expert_shared_feed_forward_length")) or metadata.get(key("feed_forward_length"))
        return fields | {"norm_topk_prob": False, "shared_expert_intermediate_size": int(shared)}
    # llama.cpp always renormalises qwen3moe's top-k weights, as Qwen3-MoE's configs ask
    return fields | {"norm_topk_prob": True}


def _rope_scaling(metadata: dict[str, Any], key) -> dict[str, Any]:
    kind = metadata.get(key("rope.scaling.type"), "none")
    if kind == "none":
        return {}
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn)")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(_required(metadata, key("rope.scaling.factor")))}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = int(
            _required(metadata, key("rope.scaling.original_context_length")))
    return {"rope_scaling": scaling}


# Llama 3.x's rope: llama.cpp stores its per-frequency divisors as the tensor `rope_freqs.weight` and no metadata, so
# the HF parameters are recovered by matching the tensor against the shapes Llama 3.x ships.
_LLAMA3_CANDIDATES = tuple((low, high, original) for low in (1.0,) for high in (4.0,)
                           for original in (8192, 4096, 2048, 16384, 32768, 131072))


def llama3_divisors(head_dim: int, theta: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """HF's llama3 rope: by how much each frequency is divided (1 for short wavelengths, `factor` for long ones)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    divisor = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, divisor))


def llama3_rope(divisors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """The `rope_scaling` of a file's `rope_freqs.weight`, or a refusal when no Llama 3.x shape matches it."""
    factor = float(divisors.max())
    for low, high, original in _LLAMA3_CANDIDATES:
        if np.allclose(llama3_divisors(head_dim, theta, factor, low, high, original), divisors, rtol=1e-3):
            return {"rope_scaling": {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                     "high_freq_factor": high, "original_max_position_embeddings": original}}
    raise UnsupportedModelError("the GGUF file's rope_freqs.weight matches no Llama 3 rope scaling jengine knows")
