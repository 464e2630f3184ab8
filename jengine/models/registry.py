"""HF `architectures` → a parsed `ModelSpec`. One parser per family; an unknown architecture is refused by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jengine.errors import UnsupportedModelError
from jengine.models.spec import SUPPORTED_ROPE_TYPES, AttentionKind, MlpKind, MoeSpec, ModelSpec, RopeSpec, config_value

SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
_LAYER_TYPE_NAMES: dict[str, AttentionKind] = {"full_attention": "full", "sliding_attention": "sliding"}


def parse_rope(config: dict[str, Any]) -> RopeSpec:
    """Reads both spellings: `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (checkpoints)."""
    params = dict(config.get("rope_parameters") or {})
    if params and set(params) <= set(config.get("layer_types") or ()):
        raise UnsupportedModelError("per-layer-type rope_parameters are not supported")
    params.update({k: v for k, v in (config.get("rope_scaling") or {}).items() if v is not None})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = config_value(params, "rope_theta", default=config_value(config, "rope_theta", default=10000.0))
    original_max = config_value(params, "original_max_position_embeddings")
    if rope_type in ("llama3", "yarn") and original_max is None:
        original_max = config_value(config, "original_max_position_embeddings", "max_position_embeddings")
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":
        factor = config["max_position_embeddings"] / original_max
    return RopeSpec(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(factor if factor is not None else 1.0),
        low_freq_factor=params.get("low_freq_factor"),
        high_freq_factor=params.get("high_freq_factor"),
        original_max_position_embeddings=original_max,
        attention_factor=params.get("attention_factor"),
        beta_fast=params.get("beta_fast"),
        beta_slow=params.get("beta_slow"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        # the supported families read it from the rope parameters only (HF ignores a top-level one for them)
        partial_rotary_factor=float(config_value(params, "partial_rotary_factor", default=1.0)),
    )


def _attention_kinds(config: dict[str, Any], num_layers: int, qwen_style: bool) -> tuple[AttentionKind, ...]:
    """Per-layer full/sliding attention: `layer_types` when given, else each family's older rule."""
    if config.get("layer_types"):
        unknown = set(config["layer_types"]) - set(_LAYER_TYPE_NAMES)
        if unknown:
            raise UnsupportedModelError(f"unsupported layer_types {sorted(unknown)}")
        if len(config["layer_types"]) != num_layers:
            raise UnsupportedModelError(f"layer_types lists {len(config['layer_types'])} layers, model has {num_layers}")
        kinds = tuple(_LAYER_TYPE_NAMES[t] for t in config["layer_types"])
        return kinds if _sliding_window(config, qwen_style) else ("full",) * num_layers
    if not _sliding_window(config, qwen_style):
        return ("full",) * num_layers
    if qwen_style and "max_window_layers" in config and config.get("model_type") in ("qwen2", "qwen3"):
        first_sliding = config["max_window_layers"]
        return tuple("sliding" if i >= first_sliding else "full" for i in range(num_layers))
    return ("sliding",) * num_layers


def _sliding_window(config: dict[str, Any], qwen_style: bool) -> int | None:
    """The window in tokens, or None: Qwen configs only use it when `use_sliding_window` is true."""
    if qwen_style and not config.get("use_sliding_window", False):
        return None
    window = config.get("sliding_window")
    return int(window) if window else None


def _eos_ids(config: dict[str, Any]) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _base_fields(architecture: str, family: str, config: dict[str, Any], *, qwen_style: bool) -> dict[str, Any]:
    """Fields every family reads the same way."""
    num_layers = int(config["num_hidden_layers"])
    num_heads = int(config["num_attention_heads"])
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {hidden_act!r} is not supported; supported: {SUPPORTED_ACTIVATIONS}")
    attention_bias = bool(config.get("attention_bias", False))
    return dict(
        architecture=architecture,
        family=family,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(config_value(config, "num_key_value_heads", default=num_heads)),
        head_dim=int(config_value(config, "head_dim", default=config["hidden_size"] // num_heads)),
        intermediate_size=int(config["intermediate_size"]),
        rms_norm_eps=float(config_value(config, "rms_norm_eps", default=1e-6)),
        hidden_act=hidden_act,
        rope=parse_rope(config),
        max_position_embeddings=int(config_value(config, "max_position_embeddings", default=2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=False,
        attention_kinds=_attention_kinds(config, num_layers, qwen_style),
        sliding_window=_sliding_window(config, qwen_style),
        mlp_kinds=("dense",) * num_layers,
        moe=None,
        checkpoint_dtype=config_value(config, "torch_dtype", "dtype"),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_eos_ids(config),
    )


def _llama(architecture: str, config: dict[str, Any]) -> ModelSpec:
    family = "mistral" if architecture == "MistralForCausalLM" else "llama"
    return ModelSpec(**_base_fields(architecture, family, config, qwen_style=False))


def _qwen2(architecture: str, config: dict[str, Any]) -> ModelSpec:
    fields = _base_fields(architecture, "qwen2", config, qwen_style=True)
    fields.update(qkv_bias=True, o_bias=False)  # Qwen2 always has q/k/v biases and never an o bias
    return ModelSpec(**fields)


def _qwen3(architecture: str, config: dict[str, Any]) -> ModelSpec:
    fields = _base_fields(architecture, "qwen3", config, qwen_style=True)
    fields.update(qk_norm=True)
    return ModelSpec(**fields)


def _num_experts(config: dict[str, Any]) -> int:
    return int(config_value(config, "num_experts", "num_local_experts"))


# What HF's config classes assume where a MoE config.json leaves a field out (every real config sets them)
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_experts=8, num_experts_per_tok=2, rope_theta=1e6),
    "qwen2_moe": dict(num_experts=60, num_experts_per_tok=4, shared_expert_intermediate_size=5632),
    "qwen3_moe": dict(num_experts=128, num_experts_per_tok=8),
}


def _given(config: dict[str, Any], name: str) -> bool:
    """Whether the config sets `name` where the parsers read it (the expert count under either of its names; the
    rope theta at the top or among the rope parameters, as `parse_rope` reads it)."""
    if name == "num_experts":  # transformers 5 writes num_local_experts for all three families
        return config_value(config, "num_experts", "num_local_experts") is not None
    if name == "rope_theta":
        params = {**(config.get("rope_parameters") or {}), **(config.get("rope_scaling") or {})}
        return config_value(params, "rope_theta", default=config.get("rope_theta")) is not None
    return config.get(name) is not None


def _with_hf_defaults(family: str, config: dict[str, Any]) -> dict[str, Any]:
    present = {k: v for k, v in config.items() if v is not None}
    if family != "mixtral" and present.get("use_sliding_window") and not present.get("layer_types"):
        # transformers 4 and 5 disagree on which layers then slide; real configs leave the window off
        raise UnsupportedModelError(f"{family} with use_sliding_window and no layer_types is not supported")
    return {k: v for k, v in _HF_DEFAULTS[family].items() if not _given(present, k)} | present


def _mixtral(architecture: str, config: dict[str, Any]) -> ModelSpec:
    config = _with_hf_defaults("mixtral", config)
    fields = _base_fields(architecture, "mixtral", config, qwen_style=False)
    moe = MoeSpec(
        num_experts=_num_experts(config),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        intermediate_size=int(config["intermediate_size"]),
        norm_topk_prob=True,  # Mixtral always renormalises its top-k weights
        weight_style="mixtral",
    )
    fields.update(mlp_kinds=("moe",) * fields["num_layers"], moe=moe)
    return ModelSpec(**fields)


def _qwen3_moe_layer_kinds(config: dict[str, Any], num_layers: int) -> tuple[MlpKind, ...]:
    """Qwen2-MoE and Qwen3-MoE: a layer is sparse unless listed in `mlp_only_layers`, and only every
    `decoder_sparse_step`-th."""
    dense_layers = set(config.get("mlp_only_layers") or ())
    step = int(config.get("decoder_sparse_step") or 1)
    has_experts = _num_experts(config) > 0
    return tuple(
        "moe" if has_experts and i not in dense_layers and (i + 1) % step == 0 else "dense" for i in range(num_layers)
    )


def _qwen_moe_fields(architecture: str, family: str, config: dict[str, Any], shared: bool) -> dict[str, Any]:
    """The fields Qwen2-MoE and Qwen3-MoE share: Qwen attention, sparse layers as `_qwen3_moe_layer_kinds` reads
    them, routed experts; `shared`: a shared expert too (Qwen2-MoE), where the config gives it a width."""
    config = _with_hf_defaults(family, config)
    fields = _base_fields(architecture, family, config, qwen_style=True)
    moe = MoeSpec(
        num_experts=_num_experts(config),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        intermediate_size=int(config["moe_intermediate_size"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        weight_style="qwen",
        shared_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0) if shared else 0,
    )
    return fields | dict(mlp_kinds=_qwen3_moe_layer_kinds(config, fields["num_layers"]), moe=moe)


def _qwen3_moe(architecture: str, config: dict[str, Any]) -> ModelSpec:
    return ModelSpec(**_qwen_moe_fields(architecture, "qwen3_moe", config, shared=False) | dict(qk_norm=True))


def _qwen2_moe(architecture: str, config: dict[str, Any]) -> ModelSpec:
    """Qwen1.5-MoE / Qwen2-MoE: Qwen2's attention (q/k/v biases), routed experts beside a gated shared expert."""
    fields = _qwen_moe_fields(architecture, "qwen2_moe", config, shared=True)
    return ModelSpec(**fields | dict(qkv_bias=bool(config.get("qkv_bias", True)), o_bias=False))


_PARSERS: dict[str, Callable[[str, dict[str, Any]], ModelSpec]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "MixtralForCausalLM": _mixtral,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Qwen2MoeForCausalLM": _qwen2_moe,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_PARSERS)


def spec_from_hf_config(config: dict[str, Any]) -> ModelSpec:
    """Picks the family from `architectures` and parses the config; unknown architectures are refused by name."""
    architectures = config.get("architectures") or []
    for architecture in architectures:
        if architecture in _PARSERS:
            try:
                return _PARSERS[architecture](architecture, config)
            except KeyError as missing:
                raise UnsupportedModelError(f"config.json for {architecture} lacks the field {missing}") from None
    raise UnsupportedModelError(
        f"model architecture {architectures or '(none given)'} is not supported; supported architectures: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )
