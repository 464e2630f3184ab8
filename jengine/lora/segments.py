"""The step's `LoraSegments`, built on the host from each scheduled row's adapter slot (numpy, once per step)."""

from __future__ import annotations

import numpy as np

from jengine.layers.lora import LoraSegments


def build_segments(row_slots: np.ndarray, num_scheduled: np.ndarray, num_tokens: int, num_slots: int
                   ) -> LoraSegments:
    """Token rows sorted by slot (stable), rows without an adapter (slot -1) and the padding after them.

    `row_slots` and `num_scheduled` are per scheduled request, in step order; `num_tokens` is the padded count."""
    total = int(num_scheduled.sum())
    token_slots = np.full(num_tokens, num_slots, np.int32)
    token_slots[:total] = np.repeat(np.where(row_slots < 0, num_slots, row_slots), num_scheduled)
    order = np.argsort(token_slots, kind="stable").astype(np.int32)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(num_tokens, dtype=np.int32)
    group_sizes = np.bincount(token_slots, minlength=num_slots + 1)[:num_slots].astype(np.int32)
    return LoraSegments(order, inverse, group_sizes)
