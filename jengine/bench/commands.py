"""The `jengine bench` parser: `throughput` and `latency` take the engine flags, `serve` the server's address."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jengine.bench.common import add_dataset_args


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    from jengine.cli import add_engine_args

    bench = commands.add_parser("bench", help="benchmark throughput, latency or a running server (vllm bench)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    throughput = kinds.add_parser("throughput", help="offline: LLM.generate over the whole dataset")
    add_dataset_args(throughput, seed=False)
    add_engine_args(throughput)

    latency = kinds.add_parser("latency", help="one fixed batch, timed over --num-iters runs")
    latency.add_argument("--input-len", type=int, default=32)
    latency.add_argument("--output-len", type=int, default=128)
    latency.add_argument("--batch-size", type=int, default=8)
    latency.add_argument("--num-iters-warmup", type=int, default=2)
    latency.add_argument("--num-iters", type=int, default=10)
    latency.add_argument("--output-json", type=Path, default=None, help="write the results as JSON here")
    add_engine_args(latency)

    from jengine.bench import serve as serve_bench  # httpx: only imported here

    serve = kinds.add_parser("serve", help="drive a running OpenAI server (/v1/completions, streaming)")
    add_dataset_args(serve, seed=True)
    serve_bench.add_args(serve)


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "throughput":
        from jengine.bench.throughput import run
    elif args.bench_command == "latency":
        from jengine.bench.latency import run
    else:
        from jengine.bench.serve import run
    try:
        return run(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
