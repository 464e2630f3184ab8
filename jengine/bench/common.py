"""What every bench sub-command shares: the dataset flags, building the dataset, and writing the results."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from jengine.bench.datasets import DATASETS, SampleRequest, make_dataset, vocab_ids


def add_dataset_args(parser: argparse.ArgumentParser, *, seed: bool) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset-name", default="random", choices=DATASETS)
    group.add_argument("--num-prompts", type=int, default=100)
    group.add_argument("--input-len", type=int, default=128,
                       help="prompt tokens (the median for sharegpt-like)")
    group.add_argument("--output-len", type=int, default=32,
                       help="generated tokens (the median for sharegpt-like); EOS is ignored")
    group.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    if seed:  # throughput/latency take --seed from the engine flags
        group.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path, default=None, help="write the results as JSON here")


def check_lengths(args: argparse.Namespace,
                  names: tuple[str, ...] = ("num_prompts", "input_len", "output_len")) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


def build_dataset(args: argparse.Namespace, tokenizer: Any, max_total_len: int | None = None) -> list[SampleRequest]:
    check_lengths(args)
    return make_dataset(args.dataset_name, vocab_ids(tokenizer), args.num_prompts, args.input_len, args.output_len,
                        range_ratio=args.random_range_ratio, seed=args.seed, max_total_len=max_total_len)


def acceptance_metrics(llm: Any) -> dict[str, float]:
    """Speculative decoding's acceptance over everything the engine ran (vLLM's bench figures): the rate over draft
    tokens, and the mean tokens a verification step emits per request (1 + accepted ÷ drafts); {} without it."""
    core = llm._core
    if not getattr(core, "speculative", False):
        return {}
    counts = core.scheduler.spec_counts
    return {"spec_decode_acceptance_rate": counts.acceptance_rate,
            "spec_decode_acceptance_length": 1 + counts.num_accepted_tokens / max(counts.num_drafts, 1),
            "spec_decode_num_drafts": counts.num_drafts, "spec_decode_num_draft_tokens": counts.num_draft_tokens,
            "spec_decode_num_accepted_tokens": counts.num_accepted_tokens}


def write_json(path: Path | None, results: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
