"""A tiny Llama-format checkpoint with random weights, built offline without torch.

It gives a fresh machine something real to run (`jengine generate` with no `--model`): the same HF directory layout,
safetensors loading, tokenizer and chat template as a downloaded checkpoint. Its text is noise: the weights are random.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from jengine.tokenizer.tiny import CHATML_TEMPLATE, pad_vocabulary, train_tiny_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_DEMO_DIR = Path.home() / ".cache" / "jengine" / "demo-model"
DEMO_SERVED_NAME = "jengine-demo-tiny-random"  # what `jengine serve` with no MODEL calls it: clearly not a real model
DEMO_MAX_POSITIONS = 2048  # so a served demo has max_model_len 2048, like the small real models users try first
_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def ensure_demo_model(out_dir: str | Path = DEFAULT_DEMO_DIR) -> Path:
    """Builds the demo model once; later calls reuse the directory."""
    out = Path(out_dir)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists() and _is_current(out):
        return out
    logger.info("building the demo model (random weights) in %s", out)
    return build_random_llama(out, **_SHAPE)


def build_random_llama(out_dir: str | Path, *, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                       num_attention_heads: int, num_key_value_heads: int, head_dim: int | None = None,
                       max_position_embeddings: int = DEMO_MAX_POSITIONS, vocab_size: int | None = None,
                       write_weights: bool = True) -> Path:
    """A Llama-format checkpoint of any shape with random weights and the tiny tokenizer (GPU checks use it too);
    `vocab_size` pads the tokenizer's vocabulary to a real model's size (`pad_vocabulary`); without `write_weights`
    only config and tokenizer are written (for `load_format="dummy"`)."""
    out = Path(out_dir)
    train_tiny_tokenizer(out, vocab_size=512, chat_template=CHATML_TEMPLATE)
    if vocab_size is not None:
        pad_vocabulary(out, vocab_size)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    shape = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
                 num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                 head_dim=head_dim or hidden_size // num_attention_heads)
    config = _config(vocab, shape, max_position_embeddings)
    if write_weights:
        _write_weights(out, config)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out


def _is_current(out: Path) -> bool:
    """A demo directory left by an older version (fewer positions, no chat template) is rebuilt."""
    try:
        config = json.loads((out / "config.json").read_text())
        tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("max_position_embeddings", 0) >= DEMO_MAX_POSITIONS and "chat_template" in tokenizer_config


def _config(vocab_size: int, shape: dict, max_position_embeddings: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size, **shape,
        "hidden_act": "silu", "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    }


def _write_weights(out: Path, config: dict) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    d, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * min(0.05, shape[-1] ** -0.5)).astype(np.float32)

    vocab = config["vocab_size"]
    tensors = {"model.embed_tokens.weight": normal(vocab, d), "lm_head.weight": normal(vocab, d),
               "model.norm.weight": np.ones(d, np.float32)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        tensors |= {
            prefix + "input_layernorm.weight": np.ones(d, np.float32),
            prefix + "post_attention_layernorm.weight": np.ones(d, np.float32),
            prefix + "self_attn.q_proj.weight": normal(q_out, d),
            prefix + "self_attn.k_proj.weight": normal(kv_out, d),
            prefix + "self_attn.v_proj.weight": normal(kv_out, d),
            prefix + "self_attn.o_proj.weight": normal(d, q_out),
            prefix + "mlp.gate_proj.weight": normal(inter, d),
            prefix + "mlp.up_proj.weight": normal(inter, d),
            prefix + "mlp.down_proj.weight": normal(d, inter),
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
