"""`jengine bench serve`: drives a running OpenAI server through streaming /v1/completions (httpx, asyncio).

Requests leave at Poisson arrivals of --request-rate per second (inf: all at once), at most --max-concurrency in
flight. TTFT is the time to the first SSE chunk with text, ITL the gaps between later chunks, the output length the
usage the server reports (`stream_options.include_usage`); EOS is ignored so each request generates its length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from typing import Any

import httpx
import numpy as np

from jengine.bench.common import build_dataset, write_json
from jengine.bench.datasets import SampleRequest
from jengine.bench.metrics import RequestResult, compute_metrics, format_table, parse_goodput


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="the served model name (default: the server's first model)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory to draw prompt ids from (default: --model, if a directory)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                        help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:2000 (milliseconds)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def run(args: argparse.Namespace) -> int:
    from jengine.tokenizer import Tokenizer

    slo = parse_goodput(args.goodput)
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or _first_model(args.base_url, headers)
    tokenizer_dir = args.tokenizer or model
    if not os.path.isdir(tokenizer_dir):
        raise ValueError(f"no tokenizer directory: give --tokenizer (tried {tokenizer_dir!r})")
    requests = build_dataset(args, Tokenizer.from_pretrained(tokenizer_dir))
    results, duration = asyncio.run(benchmark(args.base_url.rstrip("/") + args.endpoint, model, requests,
                                              request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                                              seed=args.seed, headers=headers, timeout=args.timeout))
    metrics = compute_metrics(results, duration, slo=slo)
    errors = sorted({r.error for r in results if not r.success})
    report: dict[str, Any] = {"benchmark": "serve", "base_url": args.base_url, "model": model,
                              "dataset_name": args.dataset_name, "num_prompts": len(requests),
                              "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
                              "max_concurrency": args.max_concurrency, "seed": args.seed, "goodput_slo_ms": slo,
                              **metrics, "errors": errors[:10]}
    print(format_table("Serving Benchmark Result", metrics))
    for error in errors[:3]:
        print(f"error: {error}")
    write_json(args.output_json, report)
    return 0 if metrics["completed"] else 1


def _first_model(base_url: str, headers: dict[str, str]) -> str:
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def benchmark(url: str, model: str, requests: list[SampleRequest], *, request_rate: float = math.inf,
                    max_concurrency: int | None = None, seed: int = 0, headers: dict[str, str] | None = None,
                    timeout: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals, bounded concurrency); returns the results in order and the wall time."""
    rng = np.random.default_rng(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers or {}) as client:
        async def one(request: SampleRequest) -> RequestResult:
            if gate is None:
                return await send(client, url, model, request)
            async with gate:
                return await send(client, url, model, request)

        start = time.perf_counter()
        tasks = []
        for i, request in enumerate(requests):
            if i and math.isfinite(request_rate):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


async def send(client: httpx.AsyncClient, url: str, model: str, request: SampleRequest) -> RequestResult:
    body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.expected_output_len,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 1.0,
            "top_p": 1.0}
    result = RequestResult(prompt_len=request.prompt_len, output_len=0, e2el=0.0)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                if chunk.get("usage"):
                    result.output_len = chunk["usage"].get("completion_tokens", 0)
                if any(choice.get("text") for choice in chunk.get("choices") or ()):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.e2el = time.perf_counter() - start
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        result.success, result.error = False, f"{type(exc).__name__}: {exc}"
        result.e2el = time.perf_counter() - start
    return result
