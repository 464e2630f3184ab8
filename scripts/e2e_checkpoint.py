"""A Llama checkpoint of any shape with random bfloat16 weights, written fast enough for a timed GPU call.

An 8B checkpoint is 16 GB: drawing 8·10⁹ normal numbers would take minutes, so one pool of random bf16 values (a
length no row size divides, so rows never repeat one another) is drawn once from a fixed seed, and every matrix is
written as pool slices from a seeded offset, straight from numpy memory to the file (safetensors written by hand,
sharded with an index as HF saves large models). Norm weights are ones. The tokenizer is the tiny byte-level BPE
grown to the model's vocabulary with word-like tokens, so every id the model can sample decodes to text as a real
tokenizer's would.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

POOL_SIZE = (1 << 24) + 4099  # not a multiple of any row length used
WEIGHT_STD = 0.02  # HF's initializer_range
SHARD_BYTES = 5 << 30
BF16_ONE = np.uint16(0x3F80)

LLAMA_31_8B: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
TINY: dict[str, Any] = {  # head_dim 64: on a GPU the engine takes its kernel path (pallas_gpu) here too
    "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
}


def llama_config(shape: dict[str, Any]) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2, **shape}


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF's names and shapes for a Llama checkpoint (projections stored [out, in])."""
    d, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv, vocab = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd, config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "self_attn.q_proj.weight": (q, d),
                   p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.v_proj.weight": (kv, d),
                   p + "self_attn.o_proj.weight": (d, q), p + "post_attention_layernorm.weight": (d,),
                   p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                   p + "mlp.down_proj.weight": (d, inter)}
    return shapes | {"model.norm.weight": (d,), "lm_head.weight": (vocab, d)}


def write_random_llama(out_dir: str | Path, shape: dict[str, Any], seed: int = 0) -> Path:
    """Config, generation config, tokenizer and sharded bf16 safetensors in `out_dir`; returns it."""
    config = llama_config(shape)
    return write_checkpoint(out_dir, config, tensor_shapes(config), seed)


def write_checkpoint(out_dir: str | Path, config: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                     seed: int = 0) -> Path:
    """Any architecture: `config` as config.json, random bf16 tensors of these names and shapes (1-D: ones)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(POOL_SIZE, np.float32) * WEIGHT_STD).astype(_bf16()).view(np.uint16)
    shards = _plan_shards(shapes)
    weight_map = {}
    for index, names in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(out / file, {n: shapes[n] for n in names}, pool, rng)
        weight_map |= dict.fromkeys(names, file)
    total = sum(int(np.prod(s)) * 2 for s in shapes.values())
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
    write_tokenizer(out, config["vocab_size"])
    return out


def _bf16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _plan_shards(shapes: dict[str, tuple[int, ...]]) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_shard(path: Path, shapes: dict[str, tuple[int, ...]], pool: np.ndarray, rng: np.random.Generator) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape in shapes.items():
            _write_values(f, int(np.prod(shape)), pool, rng, norm=len(shape) == 1)


def _write_values(f: BinaryIO, count: int, pool: np.ndarray, rng: np.random.Generator, norm: bool) -> None:
    if norm:
        f.write(np.full(count, BF16_ONE, np.uint16).tobytes())
        return
    start = int(rng.integers(0, len(pool)))
    while count:
        take = min(count, len(pool) - start)
        f.write(memoryview(pool[start:start + take]))
        count -= take
        start = 0


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """The tiny byte-level BPE, its vocabulary grown to `vocab_size` with word-like tokens (' abc', 'xyz', ...)
    that no merge produces: prompts are token ids, and every sampled id has a text."""
    from jengine.tokenizer.tiny import CHATML_TEMPLATE, train_tiny_tokenizer

    train_tiny_tokenizer(out, vocab_size=512, chat_template=CHATML_TEMPLATE)
    path = out / "tokenizer.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in tokenizer["added_tokens"]}
    next_id = max(vocab.values()) + 1
    for word in _words():
        if next_id >= vocab_size:
            break
        if word not in taken:
            vocab[word] = next_id
            next_id += 1
    path.write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")


def _words():
    letters = string.ascii_lowercase + string.ascii_uppercase
    for prefix in ("Ġ", ""):  # "Ġ" is the byte-level spelling of a leading space
        for a in letters:
            for b in letters:
                for c in letters:
                    yield prefix + a + b + c


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
