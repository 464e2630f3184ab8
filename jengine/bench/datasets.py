"""Seeded synthetic datasets: prompts are token-id lists drawn from the tokenizer's vocabulary, nothing downloaded.

`random`: input/output lengths uniform in [len·(1-r), len·(1+r)] (r = --random-range-ratio, 0 = exact lengths).
`sharegpt-like`: lognormal prompt and output lengths (medians --input-len / --output-len, ShareGPT-like spreads),
clipped to [1, 8·median] and so that prompt + output fits `max_total_len` when one is given.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

DATASETS = ("random", "sharegpt-like")
SHAREGPT_PROMPT_SIGMA = 1.0  # ShareGPT prompts spread over ~two decades
SHAREGPT_OUTPUT_SIGMA = 0.8


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    prompt_token_ids: list[int]
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def vocab_ids(tokenizer) -> np.ndarray:
    """Every id the tokenizer can produce except its special tokens (BOS/EOS/... would change what is measured)."""
    special = set(tokenizer.all_special_ids)
    ids = np.array([i for i in range(tokenizer.vocab_size) if i not in special], dtype=np.int64)
    if ids.size == 0:
        raise ValueError("the tokenizer has no non-special tokens to draw prompts from")
    return ids


def _uniform_lengths(rng: np.random.Generator, length: int, ratio: float, n: int) -> np.ndarray:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    low = max(1, math.floor(length * (1 - ratio)))
    high = max(low, math.ceil(length * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def random_dataset(ids: Sequence[int] | np.ndarray, num_prompts: int, input_len: int, output_len: int, *,
                   range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    ids = np.asarray(ids)
    in_lens = _uniform_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _uniform_lengths(rng, output_len, range_ratio, num_prompts)
    return [SampleRequest(rng.choice(ids, size=int(n)).tolist(), int(m)) for n, m in zip(in_lens, out_lens)]


def sharegpt_like_dataset(ids: Sequence[int] | np.ndarray, num_prompts: int, input_len: int, output_len: int, *,
                          seed: int = 0, max_total_len: int | None = None) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    ids = np.asarray(ids)
    in_lens = np.clip(np.rint(rng.lognormal(math.log(input_len), SHAREGPT_PROMPT_SIGMA, num_prompts)), 1,
                      8 * input_len).astype(int)
    out_lens = np.clip(np.rint(rng.lognormal(math.log(output_len), SHAREGPT_OUTPUT_SIGMA, num_prompts)), 1,
                       8 * output_len).astype(int)
    requests = []
    for n, m in zip(in_lens, out_lens):
        n, m = int(n), int(m)
        if max_total_len is not None:
            if max_total_len < 2:
                raise ValueError(f"max_total_len must be at least 2, got {max_total_len}")
            n = min(n, max_total_len - 1)
            m = min(m, max_total_len - n)
        requests.append(SampleRequest(rng.choice(ids, size=n).tolist(), m))
    return requests


def make_dataset(name: str, ids: Sequence[int] | np.ndarray, num_prompts: int, input_len: int, output_len: int, *,
                 range_ratio: float = 0.0, seed: int = 0, max_total_len: int | None = None) -> list[SampleRequest]:
    if name == "random":
        return random_dataset(ids, num_prompts, input_len, output_len, range_ratio=range_ratio, seed=seed)
    if name == "sharegpt-like":
        return sharegpt_like_dataset(ids, num_prompts, input_len, output_len, seed=seed, max_total_len=max_total_len)
    raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
