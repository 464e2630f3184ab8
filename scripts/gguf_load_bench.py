"""Load time of an 8B-shaped Q4_K GGUF file to the first token, for `scripts/bench_quant4.py --gguf`.

The file is Llama-3.1-8B-shaped and written here with `gguf`'s writer: Q4_K projections (random blocks with finite
float16 scales: valid Q4_K data, as a real file's loader sees it), a Q6_K embedding and head, F32 norms; a tiny
tokenizer stands in for Llama's (the load does not depend on it). Timed: `LLM(file, tokenizer=DIR)` until one
generated token, with lazily compiled shapes (only the step that produces the token compiles).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 4096, 14336, 32, 8, 32, 128256
_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q6_K": (208,)}


def _blocks(rng: np.random.Generator, rows: int, cols: int, type_name: str) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[type_name]:
        scale = rng.uniform(1e-4, 1e-3, size=(rows, cols // block, 1)).astype(np.float16)
        data[..., offset:offset + 2] = scale.view(np.uint8)
    return data.reshape(rows, -1)


def write_q4k_file(path: Path) -> Path:
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in ((writer.add_block_count, LAYERS), (writer.add_context_length, 8192),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, INTER),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, 500000.0),
                       (writer.add_bos_token_id, 1), (writer.add_eos_token_id, 2)):
        add(value)
    q6 = gguf.GGMLQuantizationType.Q6_K
    writer.add_tensor("token_embd.weight", _blocks(rng, VOCAB, HIDDEN, "Q6_K"), raw_dtype=q6)
    writer.add_tensor("output.weight", _blocks(rng, VOCAB, HIDDEN, "Q6_K"), raw_dtype=q6)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    q4 = gguf.GGMLQuantizationType.Q4_K
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN),
              "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
    for i in range(LAYERS):
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(HIDDEN, np.float32))
        for name, (rows, cols) in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", _blocks(rng, rows, cols, "Q4_K"), raw_dtype=q4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_to_first_token_seconds(path: Path, tokenizer_dir: Path) -> float:
    from jengine import LLM, SamplingParams

    start = time.perf_counter()
    with LLM(str(path), tokenizer=str(tokenizer_dir), max_model_len=256, max_num_seqs=4,
             compile_buckets="lazy") as llm:
        llm.generate([{"prompt_token_ids": [1, 5, 9]}], SamplingParams(max_tokens=1, ignore_eos=True))
        return time.perf_counter() - start
