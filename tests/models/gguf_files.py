"""Test-side GGUF writing: a tiny HF model → a `.gguf` file as llama.cpp's converter lays it out (its tensor names,
q/k rows permuted for llama-architecture files, norms in F32), quantized by `gguf`'s own quantizer (Q8_0, Q4_0,
BF16) or by the k-quant packers here, written from ggml's documented block layouts (checked against `gguf`'s
dequantizer in the tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

T = gguf.GGMLQuantizationType
QK = 256


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _f16_round(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).astype(np.float32)


def _asymmetric(sub: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K: per 32-value sub-block x ≈ d·sc·q − dmin·m with 6-bit sc, m; returns (d, dmin, sc, m, q)."""
    low = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - low) / levels
    d = _f16_round(scale.max(-1) / 63)
    dmin = _f16_round(-low.min(-1) / 63)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[:, :, None]
    q = np.round((sub + (dmin[:, None] * m)[:, :, None]) / np.where(step > 0, step, 1))
    return d, dmin, sc, m, np.clip(q, 0, levels).astype(np.uint8)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 scale bytes: sub-blocks 0–3 in bytes 0–7's low 6 bits; 4–7 split over bytes 8–11 and the top bits."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=1).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] 4-bit values → 128 bytes: chunk c holds sub-block 2c low, 2c + 1 high."""
    low = q[:, 0::2] & 0x0F
    high = q[:, 1::2] & 0x0F
    return (low | (high << 4)).reshape(-1, 128)


def pack_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _asymmetric(x.reshape(-1, 8, 32), 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, m), _nibbles(q)], axis=1)


def pack_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _asymmetric(x.reshape(-1, 8, 32), 31)
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for s in range(8):
        qh |= ((q[:, s] >> 4) & 1) << s
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, m), qh, _nibbles(q)], axis=1)


def pack_q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _f16_round(np.abs(scale).max(-1) / 127)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    step = (d[:, None] * sc)[:, :, None]
    q = (np.clip(np.round(sub / np.where(step != 0, step, 1)), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    ql = np.zeros((q.shape[0], 128), np.uint8)
    qh = np.zeros((q.shape[0], 64), np.uint8)
    for half in range(2):
        for j in range(4):
            values = q[:, 128 * half + 32 * j: 128 * half + 32 * j + 32]
            at = slice(64 * half + 32 * (j % 2), 64 * half + 32 * (j % 2) + 32)
            ql[:, at] |= (values & 0x0F) << (4 * (j // 2))
            qh[:, 32 * half: 32 * half + 32] |= ((values >> 4) & 3) << (2 * j)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)


UNDECODED = (T.Q8_1,)  # a ggml type the gguf package neither quantizes nor dequantizes
K_PACKERS = {T.Q4_K: (pack_q4_k, 144), T.Q5_K: (pack_q5_k, 176), T.Q6_K: (pack_q6_k, 210)}


def quantize(x: np.ndarray, qtype: T) -> np.ndarray:
    """Bytes of `x` (rows a multiple of the block) in `qtype`, shaped as `gguf` stores them."""
    if qtype in K_PACKERS:
        pack, nbytes = K_PACKERS[qtype]
        return pack(x.astype(np.float32).reshape(-1, QK)).reshape(*x.shape[:-1], x.shape[-1] // QK * nbytes)
    if qtype in UNDECODED:  # neither packer nor decoder in gguf: zero blocks, for files a reader must refuse
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((*x.shape[:-1], x.shape[-1] // block * nbytes), np.uint8)
    return gguf.quants.quantize(x.astype(np.float32), qtype)


def roundtrip(x: np.ndarray, qtype: T) -> np.ndarray:
    """What the file holds, read back by `gguf`'s dequantizer (the reference values)."""
    if qtype == T.F32:
        return x.astype(np.float32)
    if qtype in UNDECODED:
        return np.zeros_like(x, np.float32)
    return gguf.quants.dequantize(quantize(x, qtype), qtype).astype(np.float32)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for GGML's rope (the inverse of the reader's)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",  # written as llama.cpp's converter does: [hidden]
}


def _gguf_tensors(state: dict[str, np.ndarray], layers: int) -> dict[str, tuple[np.ndarray, str | None]]:
    """GGUF name → (array, HF name it came from, or None for an expert stack)."""
    out = {"token_embd.weight": (state["model.embed_tokens.weight"], "model.embed_tokens.weight"),
           "output_norm.weight": (state["model.norm.weight"], "model.norm.weight")}
    if "lm_head.weight" in state:
        out["output.weight"] = (state["lm_head.weight"], "lm_head.weight")
    for i in range(layers):
        prefix = f"model.layers.{i}."
        for hf, ours in _HF_TO_GGUF_LAYER.items():
            if prefix + hf in state:
                out[f"blk.{i}.{ours}"] = (state[prefix + hf], prefix + hf)
        fused = state.get(prefix + "mlp.experts.gate_up_proj")  # transformers 5: [experts, 2 · inter, d]
        if fused is not None:
            inter = fused.shape[1] // 2
            out[f"blk.{i}.ffn_gate_exps.weight"] = (fused[:, :inter], None)
            out[f"blk.{i}.ffn_up_exps.weight"] = (fused[:, inter:], None)
            out[f"blk.{i}.ffn_down_exps.weight"] = (state[prefix + "mlp.experts.down_proj"], None)
    return out


def _metadata(writer: gguf.GGUFWriter, config) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if experts := getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):  # Mixtral's experts are intermediate_size wide
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _llama3_divisors(config) -> np.ndarray:
    """llama.cpp's `rope_freqs.weight`: by how much Llama 3's rope divides each default frequency (from HF's own
    rope initialisation)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim = config.head_dim
    default = 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return (default / scaled).numpy().astype(np.float32)


def write_gguf(path: Path, model, arch: str, qtype_of: Callable[[str, np.ndarray], T],
               tokenizer: Callable[[gguf.GGUFWriter], None] | None = None, split_max_tensors: int = 0,
               experts_apart: bool = False) -> Path:
    """Writes `model` (HF, float32) to `path`; `qtype_of(gguf_name, array)` picks each tensor's type. Returns the
    path (with `split_max_tensors`, the first part's: gguf's writer splits as llama.cpp's tools do). The HF model's
    weights are replaced by what the file holds (read back by `gguf`'s dequantizer), so it is the exact reference
    for the file. `experts_apart`: each expert its own tensor (`blk.N.ffn_gate.E.weight`), as files converted before
    llama.cpp stacked them are."""
    config = model.config
    state = {n: t.detach().float().numpy() for n, t in model.state_dict().items()}
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    _metadata(writer, config)
    if tokenizer is not None:
        tokenizer(writer)
    held = {}
    if (config.rope_parameters or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_divisors(config))
    for name, (array, hf_name) in _gguf_tensors(state, config.num_hidden_layers).items():
        if name.endswith("ffn_gate_inp_shexp.weight"):
            array = array.reshape(-1)
        qtype = T.F32 if array.ndim == 1 else qtype_of(name, array)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
            array = permute(array, heads)
            held[hf_name] = roundtrip(state[hf_name], qtype)  # blocks lie within rows, so row order commutes
        elif hf_name is not None:
            held[hf_name] = roundtrip(array, qtype).reshape(state[hf_name].shape)
        else:
            held[name] = roundtrip(array, qtype)
        data = array.astype(np.float32) if qtype == T.F32 else quantize(array, qtype)
        if experts_apart and name.endswith("_exps.weight"):
            for e in range(array.shape[0]):
                writer.add_tensor(name.replace("_exps.weight", f".{e}.weight"), data[e], raw_dtype=qtype)
            continue
        writer.add_tensor(name, data, raw_dtype=None if qtype == T.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for i in range(config.num_hidden_layers):
        if f"blk.{i}.ffn_gate_exps.weight" in held:
            gate_up = [held.pop(f"blk.{i}.ffn_{part}_exps.weight") for part in ("gate", "up")]
            held[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate(gate_up, axis=1)
            held[f"model.layers.{i}.mlp.experts.down_proj"] = held.pop(f"blk.{i}.ffn_down_exps.weight")
    model.load_state_dict({n: torch.from_numpy(held.get(n, v).copy()) for n, v in state.items()}, strict=True)
    parts = writer.format_shard_names(Path(path)) if split_max_tensors else [Path(path)]
    return parts[0]


def tokenizer_writer(tokenizer_dir: Path) -> Callable[[gguf.GGUFWriter], None]:
    """Writes a byte-level BPE `tokenizer.json`'s vocabulary as llama.cpp's `gpt2` tokenizer metadata."""
    import json

    spec = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]

    def write(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
        writer.add_token_merges(merges)

    return write
