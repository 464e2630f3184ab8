"""Model directories of real MoE shapes for benchmarks: config.json and the demo tokenizer, no weights.

Use them with random weights made on the device, `LLM(DIR, load_format="dummy")` or
`jengine bench throughput --model DIR --load-format dummy`: the 48-layer Qwen3-30B-A3B shape is 61 GB in bfloat16
and Mixtral-8x7B 93 GB, more than a benchmark machine's disk holds as checkpoints.

    PYTHONPATH=. python scripts/moe_shapes.py qwen3-30b-a3b /tmp/qwen3-moe [--layers 12]

The configs are the published ones, except that BOS/EOS are the demo tokenizer's ids (1 and 2): its text is noise,
the vocabulary of the model stays full size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from jengine.tokenizer.tiny import CHATML_TEMPLATE, train_tiny_tokenizer

DEMO_BOS, DEMO_EOS = 1, 2

QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 40960, "max_window_layers": 48, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "initializer_range": 0.02,
}

MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "initializer_range": 0.02,
}

SHAPES: dict[str, dict[str, Any]] = {"qwen3-30b-a3b": QWEN3_30B_A3B, "mixtral-8x7b": MIXTRAL_8X7B}


def shape_config(name: str, num_layers: int | None = None, **overrides: Any) -> dict[str, Any]:
    """The config.json of shape `name` (a key of SHAPES), `num_layers` of its layers, `overrides` on top."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose {', '.join(SHAPES)}")
    config = {**SHAPES[name], "bos_token_id": DEMO_BOS, "eos_token_id": DEMO_EOS, **overrides}
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
        if "max_window_layers" in config:
            config["max_window_layers"] = num_layers
    return config


def write_shape(name: str, out_dir: str | Path, num_layers: int | None = None, **overrides: Any) -> Path:
    """Writes config.json, generation_config.json and the demo tokenizer (with a ChatML template) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = shape_config(name, num_layers, **overrides)
    train_tiny_tokenizer(out, vocab_size=512, chat_template=CHATML_TEMPLATE)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": DEMO_BOS, "eos_token_id": DEMO_EOS}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the model has")
    args = parser.parse_args()
    print(write_shape(args.shape, args.out_dir, args.layers))


if __name__ == "__main__":
    main()
