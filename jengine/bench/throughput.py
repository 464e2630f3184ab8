"""`jengine bench throughput`: the whole dataset through `LLM.generate` at once (offline), EOS ignored so every
request generates exactly its requested length; latencies come from each RequestOutput's metrics."""

from __future__ import annotations

import argparse
import time
from typing import Any

from jengine.bench.common import acceptance_metrics, build_dataset, write_json
from jengine.bench.metrics import RequestResult, compute_metrics, format_table


def run(args: argparse.Namespace) -> int:
    from jengine import LLM, SamplingParams
    from jengine.cli import engine_kwargs, model_source
    from jengine.models.demo import DEMO_SERVED_NAME

    model = args.model or DEMO_SERVED_NAME  # a directory, a hub id, or the demo model
    with LLM(model, **model_source(args), **engine_kwargs(args)) as llm:
        requests = build_dataset(args, llm.get_tokenizer(), args.max_model_len)
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [SamplingParams(max_tokens=r.expected_output_len, ignore_eos=True, temperature=1.0, top_p=1.0,
                                 seed=args.seed + i) for i, r in enumerate(requests)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        duration = time.perf_counter() - start
        acceptance = acceptance_metrics(llm)
    results = [_result(output) for output in outputs]
    metrics = compute_metrics(results, duration, streamed=False) | acceptance
    report: dict[str, Any] = {"benchmark": "throughput", "model": model, "dataset_name": args.dataset_name,
                              "num_prompts": len(requests), "seed": args.seed, **metrics}
    print(format_table("Offline Throughput Benchmark Result", metrics))
    write_json(args.output_json, report)
    return 0


def _result(output: Any) -> RequestResult:
    m = output.metrics
    e2el = m.e2e if m is not None and m.e2e is not None else 0.0
    return RequestResult(prompt_len=len(output.prompt_token_ids), output_len=len(output.outputs[0].token_ids),
                         e2el=e2el, ttft=m.ttft if m is not None else None,
                         success=output.outputs[0].finish_reason in ("length", "stop"))
