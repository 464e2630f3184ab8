"""`jengine bench latency`: one fixed batch (--batch-size prompts of --input-len tokens, --output-len generated,
EOS ignored) run --num-iters times after --num-iters-warmup; reports the per-iteration latency percentiles."""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from jengine.bench.common import acceptance_metrics, check_lengths, write_json
from jengine.bench.datasets import random_dataset, vocab_ids
from jengine.bench.metrics import PERCENTILES, format_table


def run(args: argparse.Namespace) -> int:
    from jengine import LLM, SamplingParams
    from jengine.cli import engine_kwargs, model_source
    from jengine.models.demo import DEMO_SERVED_NAME

    check_lengths(args, ("input_len", "output_len"))
    if args.batch_size < 1 or args.num_iters < 1 or args.num_iters_warmup < 0:
        raise ValueError("--batch-size and --num-iters must be at least 1, --num-iters-warmup at least 0")
    model = args.model or DEMO_SERVED_NAME  # a directory, a hub id, or the demo model
    with LLM(model, **model_source(args), **engine_kwargs(args)) as llm:
        batch = random_dataset(vocab_ids(llm.get_tokenizer()), args.batch_size, args.input_len, args.output_len,
                               seed=args.seed)
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in batch]
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0, top_p=1.0)
        for _ in range(args.num_iters_warmup):
            llm.generate(prompts, params, use_tqdm=False)
        latencies = []
        for _ in range(args.num_iters):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            latencies.append(time.perf_counter() - start)
        acceptance = acceptance_metrics(llm)
    metrics = latency_metrics(latencies) | acceptance
    report: dict[str, Any] = {"benchmark": "latency", "model": model, "batch_size": args.batch_size,
                              "input_len": args.input_len, "output_len": args.output_len, **metrics,
                              "latencies": latencies}
    print(format_table("Latency Benchmark Result", metrics))
    write_json(args.output_json, report)
    return 0


def latency_metrics(latencies: list[float]) -> dict[str, float]:
    ms = np.asarray(latencies) * 1000.0
    out = {"avg_latency": float(np.mean(latencies)), "mean_latency_ms": float(ms.mean())}
    out.update({f"p{p}_latency_ms": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out
