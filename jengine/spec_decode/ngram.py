"""Prompt lookup (`method: ngram`): the tokens that followed the first occurrence of a request's last n
tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs. Vectorised numpy over all rows at
once (one sliding-window comparison per n), no model and no device work.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: np.ndarray, lengths: np.ndarray, lookup_min: int, lookup_max: int,
                  num_drafts: int) -> list[list[int]]:
    """Drafts per row of `token_ids` [rows, width] (row r's first `lengths[r]` tokens are its history): up to
    `num_drafts` tokens each, possibly none."""
    rows = len(lengths)
    if rows == 0:
        return []
    width = int(lengths.max())
    history = token_ids[:, :width]
    starts = np.full(rows, -1, np.int64)  # where the proposed continuation starts in each row's history
    for n in range(lookup_max, lookup_min - 1, -1):
        pending = (starts < 0) & (lengths > n)
        if width <= n or not pending.any():
            continue
        suffix = history[np.arange(rows)[:, None], lengths[:, None] - n + np.arange(n)]  # [rows, n]
        windows = sliding_window_view(history[:, : width - 1], n, axis=1)  # [rows, width - n, n]
        match = (windows == suffix[:, None, :]).all(axis=-1)
        match &= np.arange(windows.shape[1])[None, :] + n < lengths[:, None]  # an earlier window, not the suffix
        first = np.argmax(match, axis=1)  # the earliest: the longest continuation (a recent one may be cut short)
        found = pending & match.any(axis=1)
        starts[found] = first[found] + n
    drafts = []
    for r in range(rows):
        start = int(starts[r])
        drafts.append([] if start < 0 else token_ids[r, start : min(start + num_drafts, int(lengths[r]))].tolist())
    return drafts
