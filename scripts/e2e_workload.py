"""The requests both sides run, built once in the orchestrating process and handed to each worker as JSON, and how HF
batches the mixed workload.

HF on the mixed workload: requests sorted by prompt length, cut into fixed batches of one size, each batch left-padded
to its longest prompt and generating until its longest requested output (EOS ignored); only the tokens each request
asked for count as output. The last batch is filled up to the fixed size with copies of its shortest request, whose
tokens do not count, so every batch has the one shape HF compiled for.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class HfBatch:
    prompts: list[list[int]]  # sorted by length; fillers (copies) last
    max_new_tokens: int  # the longest requested output among the real requests
    counted_tokens: int  # output tokens the real requests asked for

    @property
    def prompt_len(self) -> int:
        """The padded prompt length (every row left-padded to it)."""
        return max(len(p) for p in self.prompts)


def fixed_prompts(vocab: np.ndarray, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of exactly `length` ids drawn from `vocab`."""
    rng = np.random.default_rng(seed)
    return rng.choice(vocab, size=(count, length)).tolist()


def shape_prompt_sets(vocab: np.ndarray, batch: int, length: int, runs: int, seed: int) -> dict[str, list]:
    """For one batch size: a warm-up set, and `runs` sets each for the long and the short timed runs; every set is
    fresh, so no run finds another's prompt in a prefix cache."""
    def make(kind: int, run: int) -> list[list[int]]:
        return fixed_prompts(vocab, batch, length, seed=seed + 1000 * batch + 10 * run + kind)

    return {"warm": make(0, 0), "long": [make(1, r) for r in range(runs)], "short": [make(2, r) for r in range(runs)]}


def mixed_requests(vocab: np.ndarray, count: int, input_len: int, output_len: int, max_total_len: int,
                   seed: int) -> list[Request]:
    """The engine bench's seeded ShareGPT-like mix (lognormal prompt and output lengths)."""
    from jengine.bench.datasets import sharegpt_like_dataset

    samples = sharegpt_like_dataset(vocab, count, input_len, output_len, seed=seed, max_total_len=max_total_len)
    return [Request(s.prompt_token_ids, s.expected_output_len) for s in samples]


def hf_batches(requests: list[Request], batch_size: int) -> list[HfBatch]:
    """Sorted by prompt length (stable), cut into batches of `batch_size`; the last one filled with copies."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    ordered = sorted(requests, key=lambda r: len(r.prompt))
    batches = []
    for start in range(0, len(ordered), batch_size):
        real = ordered[start:start + batch_size]
        fillers = [real[0].prompt] * (batch_size - len(real))
        batches.append(HfBatch([r.prompt for r in real] + fillers, max(r.max_tokens for r in real),
                               sum(r.max_tokens for r in real)))
    return batches


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, attention mask), both [batch, longest prompt], padding on the left as HF generation expects."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return ids, mask


def save_requests(path: Path, requests: list[Request]) -> None:
    path.write_text(json.dumps([[r.prompt, r.max_tokens] for r in requests]))


def load_requests(path: Path) -> list[Request]:
    return [Request(prompt, max_tokens) for prompt, max_tokens in json.loads(path.read_text())]
