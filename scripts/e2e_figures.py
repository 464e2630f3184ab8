"""The ratios and derived metrics of each part, from the workers' raw figures (pure arithmetic, no device), and the
description of how each part measures them.

Each function takes the metrics dicts the workers wrote and returns (metrics, ratios); a figure whose inputs are
missing (its section failed) is left out rather than guessed.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

from e2e_roofline import (LlamaShape, decode_step_bytes, decode_step_flops, floor_seconds, prefill_flops,
                          roofline_seconds)

Figures = tuple[dict[str, float], dict[str, float]]

# How each part measures its figures (formatted with the run's sizes into the results file's "methods").
METHODS = {
    "shapes": (
        "HF: generate, greedy, EOS ignored; best = cache_implementation='static' (generate compiles the decode "
        "step, torch.compile mode reduce-overhead), the cache sized to each call; default = dynamic cache, eager "
        "(PyTorch's cuDNN attention backend off: it plans each new sequence length, tens of ms each, at every "
        "dynamic-cache step). Step = (median of {runs} synchronised {new}-token runs - median of {runs} "
        "{short}-token runs) / ({new} - {short}), after a warm-up run. jengine: LLM.generate, the same prompts; "
        "step = median interval between the starts of consecutive engine steps that are pure decodes of exactly B "
        "requests (host work included), over {runs} runs; *_by_difference is HF's method, a cross-check. Floor = "
        "(all weights but the embedding table + B embedding rows + K/V of the attended positions, bf16) / copy "
        "bandwidth (bytes read + written of a 2 GiB device copy, JAX); decode_b1_vs_floor = jengine step / floor "
        "at batch 1 (lower is better)."),
    "mixed": (
        "{num_prompts} ShareGPT-like requests (jengine.bench sharegpt-like, medians {input_len}/{output_len}, "
        "seed 0), greedy, EOS ignored. jengine: one LLM.generate of all, wall time after a warm-up. HF "
        "(configurations as in shapes): sorted by prompt length, fixed batches of the largest power of two <= 256 "
        "whose cache and prefill activations fit, left-padded, each batch generating its longest requested output; "
        "the last batch filled with copies that do not count; every batch shape warmed up (compiled) first, then "
        "all batches timed back to back. Output tokens = the tokens the requests asked for. "
        "throughput_vs_hf[_default] = jengine tokens/s / HF's. kv_waste_fraction = mean over jengine's steps of "
        "unfilled / allocated KV slots of the running requests."),
    "engine": (
        "Start: seconds from spawning a fresh process to its first generated token (import, weights, compiled "
        "steps, one request); cold = an empty compilation cache directory, warm = the same directory again. "
        "Decode: {batch} requests of {prompt_len}-token prompts, {max_tokens} new tokens; step = median interval "
        "between starts of pure-decode steps of all {batch} requests (their mean context per request: "
        "jengine_roofline_context); device time = the runner's jitted step called again back to back on one such "
        "step's inputs (median of 3 runs of 10, one sync per run). Roofline = max(bytes / copy bandwidth, FLOPs / "
        "bf16 matmul rate (8192^3, JAX, random data)) at the measured mean context; decode_b256_roofline_fraction "
        "= roofline / step. host_fraction_b256 = (step - device time) / step: host time not hidden behind the "
        "device. TTFT: one request at a time, one token, {system_len}-token shared system prompt + {suffix_len} "
        "fresh tokens, median of {n} after one that fills the cache; prefix_cache_ttft_speedup = TTFT caching off "
        "/ on; ttft_caching_on_device_ms = one more such request's single step replayed (device time, as above). "
        "The start workers' details keep the engine's start-up log lines (startup_log, seconds since spawn)."),
    "prefill": (
        "TTFT at batch 1: one request at a time of {lengths} fresh random prompt tokens (no prefix shared), one "
        "token, greedy; median of {runs} after one warm-up request per length; engine as the other parts but "
        "max_model_len {max_model_len} and {budget} batched tokens a step (chunked prefill). FLOP floor = (2 x "
        "every layer matrix x prompt tokens + the LM head for the last token + causal attention 2 x head_dim x "
        "heads x layers x n(n+1)) / bf16 matmul rate (8192^3, JAX, the same process); ttft_<n>_vs_flop_floor = "
        "TTFT / floor (lower is better)."),
    "defaults": (
        "`jengine bench throughput --dataset-name sharegpt-like --num-prompts {num_prompts} --input-len {input_len} "
        "--output-len {output_len}` and nothing else but the model and one fresh --compilation-cache-dir shared by "
        "three processes in turn: --compile-buckets all (filling the cache), the defaults (warm), --compile-buckets "
        "all (warm). Output tokens/s as the command reports it (generate's wall time); "
        "default_vs_precompiled_throughput = defaults / the warm all."),
}


def shapes_figures(shape: LlamaShape, hf: dict[str, float], ours: dict[str, float], sizes: list[int],
                   first_tokens: dict[str, list[int]]) -> Figures:
    """Per batch: the floor and each side's step against it; decode_b1_vs_floor = our step ÷ floor at batch 1."""
    metrics: dict[str, float] = {}
    ratios: dict[str, float] = {}
    copy = ours.get("copy_bytes_per_s")
    for b in sizes:
        step_ms, context = ours.get(f"jengine_decode_ms_b{b}"), ours.get(f"jengine_decode_context_b{b}")
        if copy and context:
            floor_ms = floor_seconds(shape, [round(context)] * b, copy) * 1e3
            metrics[f"floor_ms_b{b}"] = floor_ms
            if step_ms:
                metrics[f"jengine_decode_b{b}_vs_floor"] = step_ms / floor_ms
                if b == 1:
                    ratios["decode_b1_vs_floor"] = step_ms / floor_ms
        for config in ("best", "default"):
            theirs = hf.get(f"hf_{config}_decode_ms_b{b}")
            if theirs and step_ms:
                metrics[f"decode_b{b}_hf_{config}_over_jengine"] = theirs / step_ms
    agreement = greedy_agreement(first_tokens, sizes)
    if agreement is not None:
        metrics["first_token_agreement_hf_best_vs_jengine"] = agreement
    return metrics, ratios


def greedy_agreement(first_tokens: dict[str, list[int]], sizes: list[int]) -> float | None:
    """Fraction of rows whose first greedy token is the same on both sides, at the first batch size both ran: a
    check that both loaded the same weights the same way (random bf16 weights leave some near-ties)."""
    for b in sizes:
        theirs, ours = first_tokens.get(f"best_b{b}"), first_tokens.get(f"jengine_b{b}")
        if theirs and ours and len(theirs) == len(ours) and b > 1:
            return sum(x == y for x, y in zip(theirs, ours)) / len(ours)
    return None


def mixed_figures(hf: dict[str, float], ours: dict[str, float]) -> Figures:
    """Output tokens/s ratios (higher is better) and the KV waste of our run (lower is better)."""
    ratios: dict[str, float] = {}
    tokens_per_s = ours.get("jengine_mixed_tokens_per_s")
    for config, name in (("best", "throughput_vs_hf"), ("default", "throughput_vs_hf_default")):
        theirs = hf.get(f"hf_{config}_mixed_tokens_per_s")
        if theirs and tokens_per_s:
            ratios[name] = tokens_per_s / theirs
    if "kv_waste_fraction" in ours:
        ratios["kv_waste_fraction"] = ours["kv_waste_fraction"]
    return {}, ratios


def combine_hf_shares(metrics: dict[str, float]) -> Figures:
    """HF's mixed throughput from shares of its batches run in separate calls (`--hf-share k/n`), once every share
    of one split is present with one batch size: counted tokens over summed seconds. jengine ran the whole workload
    in each of those calls; its side of the ratio is the mean of those runs."""
    out_metrics: dict[str, float] = {}
    ratios: dict[str, float] = {}
    ours = [v for key, v in metrics.items() if key.startswith("jengine_mixed_tokens_per_s_share")]
    for config, name in (("best", "throughput_vs_hf"), ("default", "throughput_vs_hf_default")):
        for n in sorted({int(m.group(1)) for key in metrics
                         if (m := re.fullmatch(rf"hf_{config}_mixed_seconds_share\d+of(\d+)", key))}):
            tags = [f"share{k}of{n}" for k in range(n)]
            if not all(f"hf_{config}_mixed_seconds_{t}" in metrics for t in tags):
                continue
            if len({metrics.get(f"hf_{config}_mixed_batch_size_{t}") for t in tags}) != 1:
                continue  # a share that fell back to a smaller batch cut the workload differently
            seconds = sum(metrics[f"hf_{config}_mixed_seconds_{t}"] for t in tags)
            tokens = sum(metrics[f"hf_{config}_mixed_counted_tokens_{t}"] for t in tags)
            out_metrics[f"hf_{config}_mixed_seconds"] = seconds
            out_metrics[f"hf_{config}_mixed_tokens_per_s"] = tokens / seconds
            if ours:
                ratios[name] = (sum(ours) / len(ours)) / (tokens / seconds)
    return out_metrics, ratios


def engine_figures(shape: LlamaShape, ours: dict[str, float], ttft_on: list[float] | None,
                   ttft_off: list[float] | None) -> Figures:
    """Roofline fraction and host critical-path fraction of the long-context decode, and the prefix-cache TTFT
    speedup."""
    metrics: dict[str, float] = {}
    ratios: dict[str, float] = {}
    step_ms, device_ms = ours.get("jengine_roofline_step_ms"), ours.get("jengine_roofline_device_step_ms")
    copy, flops = ours.get("copy_bytes_per_s"), ours.get("matmul_flops_per_s")
    batch, context = ours.get("jengine_roofline_batch"), ours.get("jengine_roofline_context")
    if step_ms and copy and flops and batch and context:
        contexts = [round(context)] * int(batch)
        roofline_ms = roofline_seconds(shape, contexts, copy, flops) * 1e3
        metrics |= {"roofline_ms_b256": roofline_ms,
                    "roofline_byte_ms_b256": floor_seconds(shape, contexts, copy) * 1e3,
                    "roofline_flop_ms_b256": decode_step_flops(shape, contexts) / flops * 1e3,
                    "roofline_gb_per_step_b256": decode_step_bytes(shape, contexts) / 1e9}
        ratios["decode_b256_roofline_fraction"] = roofline_ms / step_ms
    if step_ms and device_ms:
        metrics["host_critical_ms_b256"] = step_ms - device_ms
        ratios["host_fraction_b256"] = max(0.0, step_ms - device_ms) / step_ms
    if ttft_on and ttft_off:
        on, off = statistics.median(ttft_on), statistics.median(ttft_off)
        metrics |= {"ttft_caching_on_ms": on * 1e3, "ttft_caching_off_ms": off * 1e3}
        ratios["prefix_cache_ttft_speedup"] = off / on
    return metrics, ratios


def prefill_figures(shape: LlamaShape, ours: dict[str, float], lengths: list[int]) -> Figures:
    """TTFT per prompt length against its FLOP floor at the measured matmul rate."""
    metrics: dict[str, float] = {}
    ratios: dict[str, float] = {}
    flops_per_s = ours.get("matmul_flops_per_s")
    for n in lengths:
        ttft = ours.get(f"ttft_prompt{n}_ms")
        if ttft and flops_per_s:
            floor_ms = prefill_flops(shape, n) / flops_per_s * 1e3
            metrics[f"ttft_floor_prompt{n}_ms"] = floor_ms
            ratios[f"ttft_{length_name(n)}_vs_flop_floor"] = ttft / floor_ms
    return metrics, ratios


def length_name(n: int) -> str:
    """1024 → "1k", 32768 → "32k"; other lengths as they are."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def worker_metrics(*workers: dict[str, Any]) -> dict[str, float]:
    """The raw figures of the workers, ceilings in readable units."""
    merged: dict[str, float] = {}
    for data in workers:
        merged |= data.get("metrics", {})
    if "copy_bytes_per_s" in merged:
        merged["copy_tb_per_s"] = merged.pop("copy_bytes_per_s") / 1e12
    if "matmul_flops_per_s" in merged:
        merged["matmul_bf16_tflops"] = merged.pop("matmul_flops_per_s") / 1e12
    merged.pop("kv_waste_fraction", None)  # a ratio
    return merged
