"""`ModelSpec`: every setting of an HF config that changes the math, normalised once.

HF configs come in several spellings (real checkpoints vs. transformers 5 `save_pretrained`): `rope_theta` +
`rope_scaling` at the top level or one `rope_parameters` dict, `torch_dtype` or `dtype`, `num_experts` or
`num_local_experts`. The family parsers in `registry.py` read those spellings; everything downstream sees only this
frozen, hashable spec (it is a static argument of the jitted step).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jengine.errors import UnsupportedModelError

AttentionKind = Literal["full", "sliding"]
MlpKind = Literal["dense", "moe"]

# "dynamic" (NTK) is the default rope up to max_position_embeddings, which it is held to here
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding settings (HF `rope_parameters` after standardisation)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn
    attention_factor: float | None = None  # yarn: scales cos/sin
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    partial_rotary_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """Mixture-of-experts settings; `weight_style` names the checkpoint's expert tensor names."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    weight_style: Literal["mixtral", "qwen"]
    # Qwen2-MoE: a shared expert every token passes through, scaled by sigmoid(x · shared_expert_gate); 0: none
    shared_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and the "
                                        f"number of experts ({self.num_experts})")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, as far as the math is concerned."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    attention_kinds: tuple[AttentionKind, ...]  # one per layer
    sliding_window: int | None
    mlp_kinds: tuple[MlpKind, ...]  # one per layer
    moe: MoeSpec | None
    checkpoint_dtype: str | None  # "bfloat16", "float16" or "float32" as the config states it; None: unstated
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attn_logit_softcap: float | None = None
    # the tensor-parallel size the fused q/k/v and gate/up columns are grouped for (set by the loader)
    projection_shards: int = 1

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        if len(self.attention_kinds) != self.num_layers or len(self.mlp_kinds) != self.num_layers:
            raise UnsupportedModelError(f"per-layer settings must list {self.num_layers} layers")
        if "sliding" in self.attention_kinds and not self.sliding_window:
            raise UnsupportedModelError("layer_types has sliding_attention layers but sliding_window is not set")
        if "moe" in self.mlp_kinds and self.moe is None:
            raise UnsupportedModelError("MoE layers need the expert settings")

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per-layer sliding window in tokens, 0 for full attention."""
        return tuple(self.sliding_window if kind == "sliding" else 0 for kind in self.attention_kinds)


def config_value(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` present (and not None) in an HF config dict."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default
