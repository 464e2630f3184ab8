"""GGUF files written by `gguf`'s writer from tiny HF models load with HF's logits.

Each file's HF model is given the weights the file holds (read back by `gguf`'s own dequantizer), so the float32
logits must match it to 1e-4 · max|ref| (the parity tolerance): that checks the metadata → config mapping, the tensor
names, llama's q/k row order and our dequantizers at once. Against the original float weights the logits stay within
each format's error (stated per test).
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from jengine.errors import CheckpointError, UnsupportedModelError
from jengine.models.gguf.dequant import dequantize
from jengine.models.loader import load_model
from jengine.runner.simple import SimpleGenerator
from tests.conftest import COMMON
from jengine.models.gguf.tokenizer import embedded_tokenizer_dir
from tests.models.gguf_files import T, quantize, tokenizer_writer, write_gguf

PROMPTS = [[1, 5, 9, 77, 300, 12, 4], [1, 200, 3, 3, 8]]
F32_TOL = 1e-4
K_SHAPE = dict(COMMON, hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2)  # k-quant rows are multiples of 256 values


def _hf_logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def _our_logits(path) -> list[np.ndarray]:
    spec, params, dtype = load_model(path, dtype="float32", progress=False)
    return SimpleGenerator(spec, params, dtype, block_size=4).generate(PROMPTS, 1, return_prompt_logits=True
                                                                       ).prompt_logits


def _build(config, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


def check_file(path, model, original, tolerance: float) -> None:
    """Equal to HF on the file's weights; within `tolerance` · max|ref| of the float model's logits."""
    for prompt, ours in zip(PROMPTS, _our_logits(path), strict=True):
        ref = _hf_logits(model, prompt)
        assert np.abs(ours - ref).max() <= F32_TOL * np.abs(ref).max()
        float_ref = _hf_logits(original, prompt)
        assert np.abs(ours - float_ref).max() <= tolerance * np.abs(float_ref).max()


def _pair(config):
    original = _build(config)
    model = _build(config)
    return model, original


@pytest.mark.parametrize("qtype,tolerance", [(T.Q8_0, 0.02), (T.BF16, 0.02), (T.Q4_0, 0.5)])
def test_gguf_llama_permuted_qk(tmp_path, qtype, tolerance):
    """Llama files carry q/k rows permuted for GGML's rope; GQA (4 over 2 heads) so q and k permute differently."""
    model, original = _pair(LlamaConfig(**COMMON))
    path = write_gguf(tmp_path / "llama.gguf", model, "llama", lambda name, a: qtype)
    check_file(path, model, original, tolerance)


def test_gguf_llama3_rope_from_rope_freqs(tmp_path):
    """Llama 3.x files carry their rope scaling only as the tensor rope_freqs.weight."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model, original = _pair(LlamaConfig(**COMMON, head_dim=32, rope_parameters=rope))
    path = write_gguf(tmp_path / "llama3.gguf", model, "llama", lambda name, a: T.Q8_0)
    check_file(path, model, original, 0.02)


def test_gguf_q8_0_projections_run_in_int8(tmp_path, caplog):
    """Q8_0 projections take the int8 path (one scale per 32 inputs, Q8_0's own blocks); a Q4_0 one fused with them
    keeps all three dequantized; the embedding is dequantized."""
    from jengine.layers.quant import QuantizedWeight

    model = _build(LlamaConfig(**COMMON))
    path = write_gguf(tmp_path / "mixed.gguf", model, "llama",
                      lambda name, a: T.Q4_0 if name == "blk.1.attn_v.weight" else T.Q8_0)
    with caplog.at_level(logging.INFO, logger="jengine.models.gguf.reader"):
        _, params, _ = load_model(path, dtype="float32", progress=False)
    assert "18 Q8_0 projections kept in 8 bits" in caplog.text  # 3 layers × 7, less layer 1's q/k/v
    layer0, layer1 = params["layers"][0], params["layers"][1]
    assert isinstance(layer0["wqkv"], QuantizedWeight) and layer0["wqkv"].scheme.label == "int8-w8a16 group 32"
    assert not isinstance(layer1["wqkv"], QuantizedWeight) and isinstance(layer1["w_down"], QuantizedWeight)
    for prompt, ours in zip(PROMPTS, _our_logits(path), strict=True):
        ref = _hf_logits(model, prompt)
        assert np.abs(ours - ref).max() <= F32_TOL * np.abs(ref).max()


def test_gguf_qwen2_biases_and_tied_head(tmp_path):
    model, original = _pair(Qwen2Config(**COMMON, tie_word_embeddings=True))
    path = write_gguf(tmp_path / "qwen2.gguf", model, "qwen2", lambda name, a: T.Q8_0)
    check_file(path, model, original, 0.02)


def test_gguf_qwen3_k_quants(tmp_path, caplog):
    """Q4_K_M's mix: Q4_K projections, Q5_K and Q6_K where llama.cpp spends more bits; the log says so."""
    mix = {"ffn_down": T.Q6_K, "attn_v": T.Q5_K, "token_embd": T.Q6_K}
    model, original = _pair(Qwen3Config(**K_SHAPE))
    path = write_gguf(tmp_path / "qwen3.gguf", model, "qwen3",
                      lambda name, a: next((q for key, q in mix.items() if key in name), T.Q4_K))
    with caplog.at_level(logging.INFO):
        check_file(path, model, original, 0.5)
    # q, k, o, gate, up of 2 layers; the head (Q4_K) and q/k (fused with a Q5_K v) are read dequantized
    assert "10 Q4_0/Q4_K projections offered in 4 bits" in caplog.text
    assert "1 Q4_K, 2 Q5_K, 3 Q6_K tensors are dequantized at load" in caplog.text
    assert "6 projections kept in 4 bits" in caplog.text  # o, gate and up of 2 layers


def test_gguf_qwen3_moe_expert_stacks(tmp_path):
    config = Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                            norm_topk_prob=True)
    model, original = _pair(config)
    path = write_gguf(tmp_path / "moe.gguf", model, "qwen3moe", lambda name, a: T.Q8_0)
    for prompt, ours in zip(PROMPTS, _our_logits(path), strict=True):
        ref = _hf_logits(model, prompt)
        assert np.abs(ours - ref).max() <= F32_TOL * np.abs(ref).max()


@pytest.mark.parametrize("experts_apart", [False, True], ids=["stacked", "one-tensor-an-expert"])
def test_gguf_mixtral(tmp_path, experts_apart):
    """Mixtral files (llama with experts, q/k permuted): expert stacks, or one tensor an expert as files converted
    before llama.cpp stacked them."""
    from transformers import MixtralConfig

    model = _build(MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2))
    path = write_gguf(tmp_path / "mixtral.gguf", model, "llama", lambda name, a: T.Q8_0, experts_apart=experts_apart)
    for prompt, ours in zip(PROMPTS, _our_logits(path), strict=True):
        ref = _hf_logits(model, prompt)
        assert np.abs(ours - ref).max() <= F32_TOL * np.abs(ref).max()


def test_gguf_qwen2_moe_shared_expert(tmp_path):
    """qwen2moe files: routed expert stacks, the shared expert and its gate vector (`[hidden]` in the file), q/k/v
    biases; llama.cpp keeps the top-k softmax weights as they are (no renormalisation)."""
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, norm_topk_prob=False)
    model = _build(config)
    path = write_gguf(tmp_path / "qwen2moe.gguf", model, "qwen2moe", lambda name, a: T.Q8_0)
    for prompt, ours in zip(PROMPTS, _our_logits(path), strict=True):  # (routing turns on the file's rounding)
        ref = _hf_logits(model, prompt)
        assert np.abs(ours - ref).max() <= F32_TOL * np.abs(ref).max()


def test_gguf_stop_tokens_per_layer_metadata_and_split_files(tmp_path):
    """llama.cpp's end-of-generation tokens (eos, eot, eom) all stop; per-layer hyper-parameter arrays read when
    uniform, refused when not."""
    from jengine.models.gguf.reader import GGUFCheckpoint

    model = _build(Qwen2Config(**COMMON))

    def extra(writer):
        writer.add_eot_token_id(7)
        writer.add_array("qwen2.attention.head_count_kv", [COMMON["num_key_value_heads"]] * 3)

    path = write_gguf(tmp_path / "stops.gguf", model, "qwen2", lambda name, a: T.Q8_0, tokenizer=extra)
    config = GGUFCheckpoint(path).config()
    assert config["eos_token_id"] == [model.config.eos_token_id, 7]
    assert config["num_key_value_heads"] == COMMON["num_key_value_heads"]

    def uneven(writer):
        writer.add_array("qwen2.feed_forward_length", [96, 96, 128])

    path = write_gguf(tmp_path / "uneven.gguf", model, "qwen2", lambda name, a: T.Q8_0, tokenizer=uneven)
    with pytest.raises(UnsupportedModelError, match=r"qwen2.feed_forward_length differs between layers \(\[96, 128"):
        GGUFCheckpoint(path)



def test_gguf_split_in_parts_reads_as_one_file(tmp_path):
    """A file split by llama.cpp's tools (`<name>-00001-of-0000N.gguf`, tensors spread over the parts, metadata in
    the first) gives the whole file's logits from its first part; a later part or a missing one is refused by name."""
    model = _build(Qwen2Config(**COMMON))
    whole = write_gguf(tmp_path / "whole.gguf", model, "qwen2", lambda name, a: T.Q8_0)
    first = write_gguf(tmp_path / "model.gguf", model, "qwen2", lambda name, a: T.Q8_0, split_max_tensors=12)
    assert first.name == "model-00001-of-00004.gguf"
    for ours, whole_logits in zip(_our_logits(first), _our_logits(whole), strict=True):
        np.testing.assert_array_equal(ours, whole_logits)
    with pytest.raises(UnsupportedModelError, match="part 2 of a GGUF file split in 4; give its first part"):
        load_model(tmp_path / "model-00002-of-00004.gguf", dtype="float32", progress=False)
    (tmp_path / "model-00003-of-00004.gguf").unlink()
    with pytest.raises(CheckpointError, match="missing beside it: model-00003-of-00004.gguf"):
        load_model(first, dtype="float32", progress=False)


def test_gguf_types_only_the_gguf_package_decodes(tmp_path, caplog):
    """llama.cpp's quantizer mixes in Q5_0 / Q5_1 / Q4_1 (e.g. where a Q4_K row is not whole 256-value blocks):
    dequantized at load through `gguf`'s decoders, the log saying how many of each."""
    mix = {"ffn_up": T.Q4_1, "ffn_down": T.Q5_0, "attn_v": T.Q5_1}
    model, original = _pair(LlamaConfig(**COMMON))
    path = write_gguf(tmp_path / "mixed.gguf", model, "llama",
                      lambda name, a: next((q for key, q in mix.items() if key in name), T.Q8_0))
    with caplog.at_level(logging.INFO, logger="jengine.models.gguf.reader"):
        check_file(path, model, original, 0.5)
    layers = COMMON["num_hidden_layers"]
    assert f"{layers} Q4_1, " in caplog.text and f"{layers} Q5_0, {layers} Q5_1" in caplog.text


def test_gguf_unsupported_type_named(tmp_path):
    model = _build(LlamaConfig(**COMMON))
    path = write_gguf(tmp_path / "q81.gguf", model, "llama", lambda name, a: T.Q8_1 if "ffn_up" in name else T.Q8_0)
    with pytest.raises(UnsupportedModelError, match="blk.0.ffn_up.weight is Q8_1, which neither jengine nor"):
        load_model(path, dtype="float32", progress=False)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.BF16, T.Q4_K, T.Q5_K, T.Q6_K])
def test_dequantizers_match_gguf(qtype):
    """Ours against `gguf.quants.dequantize` on quantized random rows and on random bytes (any bit pattern, finite
    float16 scales)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 512)).astype(np.float32)
    raw = quantize(x, qtype)
    np.testing.assert_array_equal(dequantize(raw, qtype.name, x.shape).astype(np.float32),
                                  gguf.quants.dequantize(raw, qtype))
    if qtype != T.BF16:
        noise = rng.integers(0, 256, size=raw.shape, dtype=np.uint8)
        block = gguf.GGML_QUANT_SIZES[qtype][1]
        blocks = noise.reshape(-1, block)
        for offset in ((208,) if qtype == T.Q6_K else (0, 2) if qtype in (T.Q4_K, T.Q5_K) else (0,)):
            blocks[:, offset:offset + 2] = rng.uniform(-1, 1, (len(blocks), 1)).astype(np.float16).view(np.uint8)
        np.testing.assert_array_equal(dequantize(noise, qtype.name, x.shape), gguf.quants.dequantize(noise, qtype))


@pytest.fixture(scope="module")
def qwen2_file(tmp_path_factory, tiny_tokenizer_dir):
    """A Q8_0 Qwen2 file with the tiny tokenizer's vocabulary embedded, and its reference HF model."""
    model = _build(Qwen2Config(**COMMON))
    path = tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf"
    return write_gguf(path, model, "qwen2", lambda name, a: T.Q8_0, tokenizer=tokenizer_writer(tiny_tokenizer_dir)), model


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_llm_on_a_gguf_file_with_the_base_tokenizer(qwen2_file, tiny_tokenizer_dir, tmp_path):
    """Greedy tokens as HF's; the base model's directory (`tokenizer=`) also gives the sampling defaults of its
    generation_config.json, as a model directory would."""
    import json
    import shutil

    from jengine import LLM, SamplingParams

    path, model = qwen2_file
    base = shutil.copytree(tiny_tokenizer_dir, tmp_path / "base")
    (base / "generation_config.json").write_text(json.dumps({"temperature": 0.25, "top_p": 0.5}))
    with LLM(str(path), tokenizer=str(base), dtype="float32", max_model_len=64) as llm:
        defaults = llm.get_default_sampling_params()
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert (defaults.temperature, defaults.top_p) == (0.25, 0.5)
    assert [o.outputs[0].token_ids for o in outputs] == [_hf_greedy(model, p, 8) for p in PROMPTS]


def test_embedded_vocabulary_becomes_the_tokenizer(qwen2_file, tiny_tokenizer_dir, tmp_path, caplog):
    from transformers import AutoTokenizer

    path, _ = qwen2_file
    with caplog.at_level(logging.WARNING, logger="jengine.models.gguf.tokenizer"):
        converted = embedded_tokenizer_dir(path, cache_dir=tmp_path)
    assert "slow" in caplog.text
    ours, base = AutoTokenizer.from_pretrained(converted), AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    for text in ("The quick brown fox jumps over the lazy dog", "你好，世界 🙂", "Bonjour à tous!"):
        assert ours.encode(text, add_special_tokens=False) == base.encode(text, add_special_tokens=False)
    assert embedded_tokenizer_dir(path, cache_dir=tmp_path) == converted  # converted once per file


def test_cli_generate_from_a_gguf_file(qwen2_file, tiny_tokenizer_dir, tmp_path):
    from tests.test_cli import jengine

    path, _ = qwen2_file
    result = jengine("generate", "--model", str(path), "--tokenizer", str(tiny_tokenizer_dir), "--prompt", "Hello",
                     "--max-tokens", "4", "--ignore-eos", "--max-model-len", "64", "--dtype", "float32",
                     "--compilation-cache-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "generated 4 tokens (length)" in result.stderr
    assert "Q8_0 tensors are dequantized at load" in result.stderr


@pytest.mark.parametrize("metadata,named", [
    ({"general.architecture": "gemma2"}, "'gemma2' is not supported"),
    ({"general.architecture": "qwen3moe", "qwen3moe.attention.head_count": 4, "qwen3moe.embedding_length": 64,
      "qwen3moe.block_count": 1, "qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2,
      "qwen3moe.expert_shared_count": 1}, "shared experts"),
    ({"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
      "llama.block_count": 1, "llama.rope.scaling.type": "longrope"}, "'longrope'"),
])
def test_unsupported_gguf_metadata_refused_by_name(metadata, named):
    from jengine.models.gguf.config import hf_config

    with pytest.raises(UnsupportedModelError, match=named):
        hf_config(metadata, {"token_embd.weight": (384, 64)})


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K])
def test_int4_parts_are_the_dequantized_values(qtype):
    """Q4_0 and Q4_K as (q − z)·s per 32 inputs: equal to `gguf`'s own dequantization (float32 rounding)."""
    from jengine.models.gguf.dequant import int4_parts, int4_representable

    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 512)).astype(np.float32)
    raw = quantize(x, qtype)
    q, zeros, scales = int4_parts(raw, qtype.name, x.shape)
    assert int4_representable(raw, qtype.name) and q.dtype == np.uint8 and q.max() <= 15
    ours = (q - np.repeat(zeros, 32, axis=1)) * np.repeat(scales, 32, axis=1)
    want = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_a_q4_k_sub_block_with_no_scale_but_an_offset_is_not_offered_packed():
    from jengine.models.gguf.dequant import int4_representable

    raw = quantize(np.random.default_rng(2).normal(size=(2, 256)).astype(np.float32), T.Q4_K)
    blocks = raw.reshape(-1, 144).copy()
    blocks[0, 4] &= 0xC0  # sub-block 0's scale to 0 (its min, byte 8's low 6 bits, stays non-zero)
    blocks[0, 8] |= 0x01
    assert not int4_representable(blocks, "Q4_K")


def test_gguf_q4_projections_stay_packed(tmp_path, caplog):
    """Llama with Q4_0 and Q4_K projections (q/k rows permuted in the file): the projections the W4A16 kernel takes
    stay packed in groups of 32, and the logits are HF's on the file's weights."""
    from jengine.layers.quant4 import Int4Weight

    model, original = _pair(LlamaConfig(**K_SHAPE))
    path = write_gguf(tmp_path / "q4.gguf", model, "llama",
                      lambda name, a: T.Q4_0 if "attn" in name else T.Q4_K)
    with caplog.at_level(logging.INFO):
        check_file(path, model, original, 0.5)
    _, params, _ = load_model(path, dtype="float32", progress=False)
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        w = params["layers"][0][name]
        assert isinstance(w, Int4Weight) and w.group == 32, name
    assert params["layers"][0]["wo"].zeros.dtype == np.float16  # Q4_0: zero point 8, float16 d
    assert params["layers"][0]["w_down"].zeros.dtype == np.float32  # Q4_K: fractional zero points


def test_gguf_moe_experts_in_q4_k_stay_packed(tmp_path):
    from jengine.layers.quant4 import Int4Experts

    config = Qwen3MoeConfig(**K_SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                            norm_topk_prob=True)
    model, original = _pair(config)
    # the router, embedding and head in 8 bits, as llama.cpp's Q4_K_M keeps them finer
    finer = ("gate_inp", "token_embd", "output")
    path = write_gguf(tmp_path / "moe-q4k.gguf", model, "qwen3moe",
                      lambda name, a: T.Q8_0 if any(key in name for key in finer) else T.Q4_K)
    check_file(path, model, original, 0.5)
    _, params, _ = load_model(path, dtype="float32", progress=False)
    stack = params["layers"][1]["we_down"]
    assert isinstance(stack, Int4Experts) and stack.shape == (4, 256, 256) and stack.group == 32


def test_gguf_q4_k_through_the_w4a16_kernel_matches_the_reference_path(tmp_path, monkeypatch):
    """The packed Q4_K projections (groups of 32, fractional zero points) through the W4A16 kernels in interpret
    mode give the CPU reference path's logits within 1e-5 · max|ref|."""
    model, _ = _pair(LlamaConfig(**K_SHAPE))
    path = write_gguf(tmp_path / "q4k.gguf", model, "llama", lambda name, a: T.Q4_K)
    reference = _our_logits(path)
    monkeypatch.setattr("jengine.models.quant4_place.int4_impl", lambda platform: "pallas_interpret")
    for ours, ref in zip(_our_logits(path), reference, strict=True):
        assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()


def test_gguf_q4_k_m_moe_keeps_gate_and_up_packed_beside_a_q6_k_down(tmp_path):
    """Q4_K_M keeps some down projections in Q6_K: those layers read gate/up packed (one launch) and down in float
    (its own launch); the logits are HF's on the file's weights."""
    from jengine.layers.quant4 import Int4Experts

    config = Qwen3MoeConfig(**K_SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                            norm_topk_prob=True)
    model, original = _pair(config)
    finer = ("gate_inp", "token_embd", "output")
    path = write_gguf(tmp_path / "moe-q4km.gguf", model, "qwen3moe",
                      lambda name, a: T.Q8_0 if any(key in name for key in finer)
                      else T.Q6_K if name == "blk.0.ffn_down_exps.weight" else T.Q4_K)
    check_file(path, model, original, 0.5)
    _, params, _ = load_model(path, dtype="float32", progress=False)
    first, second = params["layers"]
    assert isinstance(first["we_gate"], Int4Experts) and not isinstance(first["we_down"], Int4Experts)
    assert all(isinstance(second[name], Int4Experts) for name in ("we_gate", "we_up", "we_down"))
