"""`jengine bench`: metrics on hand-made timings, seeded datasets, and throughput / serve end to end on a tiny model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import LlamaConfig

from jengine import cli
from jengine.bench.datasets import make_dataset, random_dataset, sharegpt_like_dataset, vocab_ids
from jengine.bench.latency import latency_metrics
from jengine.bench.metrics import RequestResult, compute_metrics, format_table, parse_goodput
from tests.conftest import COMMON

ROOT = Path(__file__).resolve().parents[2]
LATENCY_KEYS = [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "p50", "p90",
                                                                                                 "p99")]
THROUGHPUT_KEYS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                   "request_throughput", "output_throughput", "total_token_throughput"]


# ---------------------------------------------------------------- metrics
def hand_made() -> list[RequestResult]:
    return [
        RequestResult(prompt_len=10, output_len=5, ttft=0.1, e2el=0.5, itls=[0.1, 0.1, 0.1, 0.1]),  # TPOT 0.4/4
        RequestResult(prompt_len=20, output_len=3, ttft=0.3, e2el=0.7, itls=[0.2, 0.2]),  # TPOT 0.4/2
        RequestResult(prompt_len=30, output_len=1, ttft=0.2, e2el=0.2),  # one token: no TPOT
        RequestResult(prompt_len=40, output_len=0, e2el=0.05, success=False, error="boom"),  # not counted
    ]


def test_tpot_is_the_time_after_the_first_token_per_later_token():
    first, second, single, failed = hand_made()
    assert first.tpot == pytest.approx(0.1) and second.tpot == pytest.approx(0.2)
    assert single.tpot is None and failed.tpot is None


def test_throughput_and_percentiles_by_hand():
    m = compute_metrics(hand_made(), duration=2.0)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (3, 1, 60, 9)
    assert m["request_throughput"] == pytest.approx(3 / 2.0)
    assert m["output_throughput"] == pytest.approx(9 / 2.0)
    assert m["total_token_throughput"] == pytest.approx((60 + 9) / 2.0)
    # TTFT ms sorted [100, 200, 300]: p90 at rank 0.9·2 = 1.8 → 200 + 0.8·100; p99 at 1.98 → 200 + 0.98·100
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["p50_ttft_ms"] == pytest.approx(200.0)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    # TPOT ms [100, 200]: p90 at rank 0.9 → 190
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    assert m["p50_tpot_ms"] == pytest.approx(150.0)
    assert m["p90_tpot_ms"] == pytest.approx(190.0)
    assert m["p99_tpot_ms"] == pytest.approx(199.0)
    # ITL ms [100]·4 + [200]·2: mean 800/6; p50 at rank 2.5 → 100; p90 at 4.5 → 200
    assert m["mean_itl_ms"] == pytest.approx(800 / 6)
    assert m["p50_itl_ms"] == pytest.approx(100.0)
    assert m["p90_itl_ms"] == pytest.approx(200.0)
    # e2e ms sorted [200, 500, 700]: p90 at 1.8 → 500 + 0.8·200
    assert m["mean_e2el_ms"] == pytest.approx(1400 / 3)
    assert m["p50_e2el_ms"] == pytest.approx(500.0)
    assert m["p90_e2el_ms"] == pytest.approx(660.0)
    assert "request_goodput" not in m
    assert "TTFT" in format_table("t", m)


def test_goodput_counts_requests_meeting_every_slo():
    # ttft ≤ 250 ms and tpot ≤ 150 ms: the first (100, 100) and the one-token one (200, no TPOT); not the second
    m = compute_metrics(hand_made(), duration=2.0, slo=parse_goodput(["ttft:250", "tpot:150"]))
    assert m["good_requests"] == 2 and m["request_goodput"] == pytest.approx(1.0)
    # adding e2el ≤ 400 ms drops the first (500 ms)
    m = compute_metrics(hand_made(), duration=2.0, slo=parse_goodput(["ttft:250", "tpot:150", "e2el:400"]))
    assert m["good_requests"] == 1 and m["request_goodput"] == pytest.approx(0.5)


@pytest.mark.parametrize("bad", ["ttft", "speed:5", "ttft:x", "tpot:0"])
def test_bad_goodput_slos_are_refused(bad):
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_latency_percentiles_by_hand():
    m = latency_metrics([0.1, 0.2, 0.3, 0.4])  # ms [100..400]: p90 at rank 2.7 → 300 + 0.7·100
    assert m["avg_latency"] == pytest.approx(0.25) and m["mean_latency_ms"] == pytest.approx(250.0)
    assert m["p50_latency_ms"] == pytest.approx(250.0) and m["p90_latency_ms"] == pytest.approx(370.0)


# ---------------------------------------------------------------- datasets
class FakeTokenizer:
    vocab_size = 50
    all_special_ids = [0, 1, 2]


def test_vocab_ids_leave_out_special_tokens():
    ids = vocab_ids(FakeTokenizer())
    assert ids.tolist() == list(range(3, 50))


def test_random_dataset_is_seeded_and_of_the_requested_lengths():
    ids = vocab_ids(FakeTokenizer())
    data = random_dataset(ids, 6, 8, 4, seed=3)
    assert [r.prompt_len for r in data] == [8] * 6 and [r.expected_output_len for r in data] == [4] * 6
    assert all(set(r.prompt_token_ids) <= set(ids.tolist()) for r in data)
    assert data == random_dataset(ids, 6, 8, 4, seed=3)
    assert data != random_dataset(ids, 6, 8, 4, seed=4)
    ranged = random_dataset(ids, 200, 10, 20, range_ratio=0.5, seed=0)
    assert {r.prompt_len for r in ranged} <= set(range(5, 16)) and len({r.prompt_len for r in ranged}) > 3
    assert {r.expected_output_len for r in ranged} <= set(range(10, 31))


def test_sharegpt_like_lengths_spread_lognormally_and_are_clipped():
    ids = vocab_ids(FakeTokenizer())
    data = sharegpt_like_dataset(ids, 500, 64, 32, seed=1)
    assert data == sharegpt_like_dataset(ids, 500, 64, 32, seed=1)
    prompt_lens = np.array([r.prompt_len for r in data])
    output_lens = np.array([r.expected_output_len for r in data])
    assert prompt_lens.min() >= 1 and prompt_lens.max() <= 8 * 64 and output_lens.max() <= 8 * 32
    assert 40 < np.median(prompt_lens) < 100 and 20 < np.median(output_lens) < 50  # medians near the lengths
    assert prompt_lens.std() > 20  # a spread, not fixed lengths
    capped = make_dataset("sharegpt-like", ids, 200, 64, 32, seed=1, max_total_len=48)
    assert all(r.prompt_len + r.expected_output_len <= 48 and r.expected_output_len >= 1 for r in capped)


# ---------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def model_dir(build_checkpoint, tiny_tokenizer_dir) -> Path:
    return build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=tiny_tokenizer_dir)[0]


def bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "jengine", "bench", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def test_bench_throughput_end_to_end(model_dir, tmp_path):
    out = tmp_path / "throughput.json"
    result = bench("throughput", "--model", str(model_dir), "--num-prompts", "4", "--input-len", "8",
                   "--output-len", "4", "--max-model-len", "64", "--compilation-cache-dir", str(tmp_path / "cache"),
                   "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    assert "Output token throughput" in result.stdout
    report = json.loads(out.read_text())
    itl_keys = {key for key in LATENCY_KEYS if "_itl_" in key}  # outputs arrive whole: no ITL to measure
    assert set(THROUGHPUT_KEYS + LATENCY_KEYS) - itl_keys <= set(report) and not itl_keys & set(report)
    assert "ITL" not in result.stdout
    assert report["benchmark"] == "throughput" and report["num_prompts"] == 4
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["total_output_tokens"] == 4 * 4 and report["total_input_tokens"] == 4 * 8
    assert report["output_throughput"] > 0 and report["mean_e2el_ms"] > 0


def test_bench_latency_end_to_end(model_dir, tmp_path):
    out = tmp_path / "latency.json"
    result = bench("latency", "--model", str(model_dir), "--batch-size", "2", "--input-len", "8", "--output-len", "4",
                   "--num-iters-warmup", "1", "--num-iters", "3", "--max-model-len", "64",
                   "--compilation-cache-dir", str(tmp_path / "cache"), "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    assert "Latency per iteration" in result.stdout
    report = json.loads(out.read_text())
    assert len(report["latencies"]) == 3 and report["batch_size"] == 2
    assert 0 < report["p50_latency_ms"] <= report["p99_latency_ms"]
    assert report["mean_latency_ms"] == pytest.approx(1000 * np.mean(report["latencies"]))


def test_bench_serve_against_a_real_server(server, chat_model_dir, tmp_path, capsys):
    out = tmp_path / "serve.json"
    code = cli.main(["bench", "serve", "--base-url", server.base_url, "--tokenizer", str(chat_model_dir),
                     "--num-prompts", "4", "--input-len", "8", "--output-len", "5", "--request-rate", "100",
                     "--max-concurrency", "2", "--goodput", "ttft:60000", "e2el:60000", "--seed", "1",
                     "--output-json", str(out)])
    assert code == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert set(THROUGHPUT_KEYS + LATENCY_KEYS) <= set(report)
    assert report["model"] == "tiny-chat" and report["completed"] == 4 and report["failed"] == 0
    assert report["total_output_tokens"] == 4 * 5 and report["total_input_tokens"] == 4 * 8
    assert report["good_requests"] == 4 and report["request_goodput"] > 0
    assert 0 < report["p50_ttft_ms"] <= report["p50_e2el_ms"] and report["mean_tpot_ms"] > 0
    assert report["max_concurrency"] == 2 and report["request_rate"] == 100
    server.wait_idle()


def test_bench_serve_reports_an_unreachable_server(chat_model_dir, tmp_path):
    out = tmp_path / "down.json"
    code = cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer",
                     str(chat_model_dir), "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
                     "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert code == 1 and report["completed"] == 0 and report["failed"] == 2 and report["errors"]
    assert math.isclose(report["request_throughput"], 0.0)


def test_bench_latency_reports_speculative_acceptance(model_dir, tmp_path):
    out = tmp_path / "latency.json"
    result = bench("latency", "--model", str(model_dir), "--batch-size", "1", "--input-len", "8", "--output-len", "16",
                   "--num-iters-warmup", "0", "--num-iters", "1", "--max-model-len", "64",
                   "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
                   "--compilation-cache-dir", str(tmp_path / "cache"), "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["spec_decode_num_drafts"] >= 0 and 0 <= report["spec_decode_acceptance_rate"] <= 1
    assert report["spec_decode_num_accepted_tokens"] <= report["spec_decode_num_draft_tokens"]
    assert "Draft acceptance rate" in result.stdout
