"""The end-to-end GPU benchmark's arithmetic and inputs, checked on the CPU: the byte/FLOP counts behind its floor and
roofline against hand-derived values, the random checkpoint it writes against those counts and HF transformers, HF's
batching of the mixed workload, and the merging of results files from several GPU calls."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import e2e_checkpoint  # noqa: E402
import e2e_roofline as roof  # noqa: E402
from e2e_figures import (  # noqa: E402
    combine_hf_shares, engine_figures, length_name, mixed_figures, prefill_figures, shapes_figures)
from e2e_workload import Request, hf_batches, left_pad  # noqa: E402
from gpu_bench_common import merge_records, result_record  # noqa: E402

LLAMA_8B = roof.LlamaShape.from_config(e2e_checkpoint.llama_config(e2e_checkpoint.LLAMA_31_8B))
# vocab 10, hidden 4, MLP 6, one layer, 2 query heads and 1 KV head of dim 2
SMALL = roof.LlamaShape(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=2, tied_embeddings=False)


def test_llama_8b_counts_match_the_published_model():
    assert LLAMA_8B.num_params == 8_030_261_248  # Llama-3.1-8B's parameter count
    assert LLAMA_8B.kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2
    # batch 1 reads every parameter but the 128256 x 4096 embedding table, plus one of its rows
    assert roof.weight_bytes_per_step(LLAMA_8B, 1) == 2 * (8_030_261_248 - 128256 * 4096 + 4096)
    # 600 attended positions (and the new one written) at 4.2 TB/s: the ~3.6 ms floor of batch-1 decode
    expected = (2 * (8_030_261_248 - 128256 * 4096 + 4096) + 131072 * 601) / 4.2e12
    assert roof.floor_seconds(LLAMA_8B, [600], 4.2e12) == pytest.approx(expected, rel=1e-12)
    assert 3.5e-3 < expected < 3.7e-3


def test_small_shape_bytes_flops_and_roofline_by_hand():
    # matrices: q 4x4 + k 4x2 + v 4x2 + o 4x4 = 48, MLP 3 x 4x6 = 72 -> 120 per layer; LM head 10x4 = 40
    assert SMALL.matmul_params == 160
    # norms 2 per layer + the final one (12), two embedding rows (8): 180 values of 2 bytes
    assert roof.weight_bytes_per_step(SMALL, 2) == 360
    assert SMALL.kv_bytes_per_token() == 8  # K and V, 1 head of 2, bf16
    # contexts 3 and 5: 8 positions read and 2 written at 8 bytes
    assert roof.decode_step_bytes(SMALL, [3, 5]) == 360 + 80
    # 2 x 160 per sequence, and QK^T + PV: 4 x head_dim 2 x 2 heads x 1 layer x 8 positions
    assert roof.decode_step_flops(SMALL, [3, 5]) == 640 + 128
    assert roof.roofline_seconds(SMALL, [3, 5], 100.0, 1000.0) == pytest.approx(4.4)  # byte-bound
    assert roof.roofline_seconds(SMALL, [3, 5], 100.0, 100.0) == pytest.approx(7.68)  # FLOP-bound


def test_largest_hf_batch_is_the_largest_power_of_two_that_fits():
    # per sequence: 7 cached positions x 8 bytes + 3 prompt tokens x (3 x 6 + 6 x 4) x 2 bytes = 56 + 252
    per_sequence = roof.hf_bytes_per_sequence(SMALL, cache_len=7, prompt_len=3)
    assert per_sequence == 308
    assert roof.largest_hf_batch(SMALL, 5 * 308, 7, 3, cap=64) == 4
    assert roof.largest_hf_batch(SMALL, 8 * 308, 7, 3, cap=64) == 8
    assert roof.largest_hf_batch(SMALL, 8 * 308, 7, 3, cap=2) == 2
    assert roof.largest_hf_batch(SMALL, 10, 7, 3, cap=64) == 1


def test_random_checkpoint_is_what_the_counts_and_transformers_expect(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(e2e_checkpoint, "SHARD_BYTES", 300_000)  # several shards, as the 8B checkpoint has
    out = e2e_checkpoint.write_random_llama(tmp_path / "model", e2e_checkpoint.TINY, seed=3)
    config = json.loads((out / "config.json").read_text())
    shape = roof.LlamaShape.from_config(config)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2 * shape.num_params
    assert len(set(index["weight_map"].values())) > 1
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert sum(p.numel() for p in model.parameters()) == shape.num_params
    weights = model.model.layers[0].mlp.down_proj.weight.float()
    assert 0.015 < weights.std().item() < 0.025 and weights.abs().max().item() > 0  # random, not zeros
    assert not torch.equal(weights[0], weights[1])  # rows differ
    assert torch.all(model.model.norm.weight == 1)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == config["vocab_size"]  # every id the model can sample has a text
    assert tokenizer.decode([config["vocab_size"] - 1]).strip()


def test_hf_batches_sort_pad_and_count_only_requested_tokens():
    rng = np.random.default_rng(0)
    requests = [Request(rng.integers(5, 100, size=int(n)).tolist(), int(m))
                for n, m in zip(rng.integers(1, 40, 11), rng.integers(1, 30, 11))]
    batches = hf_batches(requests, 4)
    assert [len(b.prompts) for b in batches] == [4, 4, 4]  # the last filled up to the fixed size
    lengths = [len(p) for b in batches for p in b.prompts[:4 - (b is batches[-1])]]
    assert lengths == sorted(len(r.prompt) for r in requests)
    assert sum(b.counted_tokens for b in batches) == sum(r.max_tokens for r in requests)
    by_length = sorted(requests, key=lambda r: len(r.prompt))
    for i, batch in enumerate(batches):
        real = by_length[4 * i:4 * i + 4]
        assert batch.max_new_tokens == max(r.max_tokens for r in real)
        assert batch.prompt_len == max(len(r.prompt) for r in real)
    assert batches[-1].prompts[-1] == batches[-1].prompts[0]  # the filler copies the shortest of its batch
    ids, mask = left_pad([[7, 8, 9], [5]], pad_id=0)
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="batch_size"):
        hf_batches(requests, 0)


def test_figures_from_worker_numbers():
    ours = {"copy_bytes_per_s": 100.0, "matmul_flops_per_s": 1000.0, "jengine_roofline_step_ms": 5000.0,
            "jengine_roofline_device_step_ms": 4000.0, "jengine_roofline_batch": 2, "jengine_roofline_context": 4,
            "jengine_decode_ms_b1": 9000.0, "jengine_decode_context_b1": 4, "jengine_mixed_tokens_per_s": 50.0,
            "kv_waste_fraction": 0.01}
    _, ratios = engine_figures(SMALL, ours, ttft_on=[0.1, 0.3, 0.2], ttft_off=[2.0, 1.0, 3.0])
    # contexts [4, 4]: 360 weight bytes + 8 x (8 + 2) KV bytes at 100 B/s = 4.4 s, over a 5 s step
    assert ratios["decode_b256_roofline_fraction"] == pytest.approx(4400 / 5000)
    assert ratios["host_fraction_b256"] == pytest.approx(0.2)  # 1 s of the 5 s step not hidden by the device
    assert ratios["prefix_cache_ttft_speedup"] == pytest.approx(2.0 / 0.2)  # medians
    metrics, ratios = shapes_figures(SMALL, {"hf_best_decode_ms_b1": 18000.0}, ours, [1, 2],
                                     {"best_b2": [1, 2], "jengine_b2": [1, 3]})
    # batch 1, context 4: (160 + 12 + one 4-value row) x 2 bytes + 8 x (4 + 1) KV bytes = 392 bytes at 100 B/s
    assert metrics["floor_ms_b1"] == pytest.approx(3920.0)
    assert ratios == {"decode_b1_vs_floor": pytest.approx(9000 / 3920)}
    assert metrics["decode_b1_hf_best_over_jengine"] == pytest.approx(2.0)
    assert metrics["first_token_agreement_hf_best_vs_jengine"] == 0.5
    _, ratios = mixed_figures({"hf_best_mixed_tokens_per_s": 5.0}, ours)
    assert ratios == {"throughput_vs_hf": 10.0, "kv_waste_fraction": 0.01}  # no default run, no ratio guessed


def test_results_from_several_calls_merge_into_one_file():
    first = result_record("e2e", "abc", "NVIDIA H200 (gpu)", {"jax": "0.11.2"}, "python a", {"m1": 1.0},
                          {"r1": 2.0}, errors={"shapes": ["x"]})
    second = result_record("e2e", "abc", "NVIDIA H200 (gpu)", {"torch": "2.11"}, "python b", {"m2": 3.0},
                           {"r1": 4.0, "r2": 5.0}, errors={"mixed": []})
    merged = merge_records(first, second)
    assert merged["metrics"] == {"m1": 1.0, "m2": 3.0}
    assert merged["ratios"] == {"r1": 4.0, "r2": 5.0}
    assert merged["versions"] == {"jax": "0.11.2", "torch": "2.11"}
    assert merged["command"] == "python a ; python b"
    assert merged["errors"] == {"shapes": ["x"], "mixed": []}
    with pytest.raises(ValueError, match="git_sha"):
        merge_records(first, second | {"git_sha": "def"})
    assert merge_records(first, second | {"git_sha": "unknown"})["git_sha"] == "abc"


def test_hf_shares_from_separate_calls_add_up_to_the_whole_workload():
    """HF's batches split over calls (`--hf-share k/n`): counted tokens over summed seconds, once every share of one
    batch size is present; jengine's side is the mean of its whole-workload runs in those calls."""
    shares = {"hf_best_mixed_seconds_share0of2": 30.0, "hf_best_mixed_counted_tokens_share0of2": 600,
              "hf_best_mixed_batch_size_share0of2": 64, "jengine_mixed_tokens_per_s_share0of2": 900.0}
    assert combine_hf_shares(shares) == ({}, {})  # half the workload: no figure yet
    shares |= {"hf_best_mixed_seconds_share1of2": 10.0, "hf_best_mixed_counted_tokens_share1of2": 200,
               "hf_best_mixed_batch_size_share1of2": 64, "jengine_mixed_tokens_per_s_share1of2": 1100.0}
    metrics, ratios = combine_hf_shares(shares)
    assert metrics["hf_best_mixed_tokens_per_s"] == pytest.approx(800 / 40)
    assert ratios == {"throughput_vs_hf": pytest.approx(1000 / 20)}
    shares["hf_best_mixed_batch_size_share1of2"] = 32  # that call fell back to a smaller batch: a different split
    assert combine_hf_shares(shares) == ({}, {})


def test_prefill_flops_by_hand_and_the_ttft_ratios():
    """SMALL by hand: 120 matrix parameters a layer, the LM head (40) for the last token only, and causal attention
    (QKᵀ and PV: 2 heads x dim 2 x 2 matmuls x 2 FLOPs per attended position; token i attends i + 1)."""
    n = 5
    attended = sum(i + 1 for i in range(n))  # 15
    expected = 2 * 120 * n + 2 * 40 + 2 * 2 * 2 * 2 * attended
    assert roof.prefill_flops(SMALL, n) == expected == 1200 + 80 + 240
    metrics, ratios = prefill_figures(SMALL, {"matmul_flops_per_s": 1e6, "ttft_prompt5_ms": 3.04}, [5, 1024])
    assert metrics == {"ttft_floor_prompt5_ms": pytest.approx(1.52)}
    assert ratios == {"ttft_5_vs_flop_floor": pytest.approx(2.0)}  # 1024 not measured: no ratio
    assert length_name(32768) == "32k" and length_name(1000) == "1000"
