"""The step's `LoraRows`, built on the host from each scheduled row's adapter slot (numpy, once per step)."""

from __future__ import annotations

import numpy as np

from jengine.layers.lora import LoraRows


def build_rows(row_slots: np.ndarray, num_scheduled: np.ndarray, num_tokens: int, num_slots: int) -> LoraRows:
    """Each token row's slot; rows without an adapter (slot -1) and the padding get `num_slots`, which no slot is.

    `row_slots` and `num_scheduled` are per scheduled request, in step order; `num_tokens` is the padded count."""
    total = int(num_scheduled.sum())
    token_slots = np.full(num_tokens, num_slots, np.int32)
    token_slots[:total] = np.repeat(np.where(row_slots < 0, num_slots, row_slots), num_scheduled)
    return LoraRows(token_slots)
