"""Structured output in the runner: a step whose sampler waits for the host's token masks, and the masks padded to
the step's rows.

A constrained step launches its forward at once and its sampler later (`ModelRunner.launch_waiting_sampler`): the
masks for step N need step N-1's tokens, which reach the host only when the device starts step N's forward, so the
host fills them while that forward runs and hands them over just before the next forward is launched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jengine.runner.protocol import TokenMaskSource
from jengine.runner.step import StepBatch


@dataclasses.dataclass(slots=True)
class WaitingSampler:
    """A step whose forward is launched and whose sampler waits for its token masks."""

    step: Any  # the runner's InFlightStep: its `out` is set when the sampler is launched
    logits: jax.Array  # the forward's float32 logits at the sampling rows
    prompt: Any  # the forward's prompt logprobs (None unless asked)
    batch: StepBatch
    token_masks: TokenMaskSource


def padded_masks(rows: np.ndarray, words: np.ndarray, num_rows: int, mask_words: int) -> np.ndarray:
    """[num_rows, mask_words]: the given rows' words, all ones elsewhere (free rows); bits past the given words (the
    model's padded vocabulary beyond the tokenizer's) banned in the given rows. When every row is given, in order and
    at the full width, that is `words` itself (no copy: a mask source hands over a fresh array per step)."""
    if words.shape == (num_rows, mask_words) and np.array_equal(rows, np.arange(num_rows)):
        return words
    mask = np.full((num_rows, mask_words), -1, np.int32)
    width = min(words.shape[1], mask_words)
    mask[rows, :width] = words[:, :width]
    mask[rows, width:] = 0
    return mask
