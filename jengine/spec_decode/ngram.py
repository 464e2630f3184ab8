"""Prompt lookup (`method: ngram`): the tokens that followed the first occurrence of a request's last n tokens, for
the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs earlier. Vectorised numpy over all rows at once:
column comparisons for the shortest n, then each longer n extends those matches by one token (a window of
n tokens matches where the window of n − 1 after it does and its first token equals the suffix's). No model, no
device work.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: np.ndarray, lengths: np.ndarray, lookup_min: int, lookup_max: int,
                  num_drafts: int) -> list[list[int]]:
    """Drafts per row of `token_ids` [rows, width] (row r's first `lengths[r]` tokens are its history): up to
    `num_drafts` tokens each, possibly none."""
    rows = len(lengths)
    width = int(lengths.max(initial=0))
    if rows == 0 or width <= lookup_min:
        return [[] for _ in range(rows)]
    history = token_ids[:, :width]
    row_index = np.arange(rows)
    suffix = history[row_index[:, None], np.clip(lengths[:, None] - lookup_min + np.arange(lookup_min), 0, None)]
    count = width - lookup_min  # window starts 0 .. width - min - 1 (a window never ends at the last column)
    match = np.ones((rows, count), bool)  # window i holds the last `lookup_min` tokens: one column compare each
    for offset in range(lookup_min):
        match &= history[:, offset : offset + count] == suffix[:, offset : offset + 1]
    starts = np.full(rows, -1, np.int64)  # where each row's continuation starts; the longest n wins
    for n in range(lookup_min, lookup_max + 1):
        if n > lookup_min:
            if width - n <= 0:
                break
            match = match[:, 1:] & (history[:, : width - n] == history[row_index, np.maximum(lengths - n, 0)][:, None])
        first = np.argmax(match, axis=1)  # the first occurrence: the longest continuation
        found = match[row_index, first] & (first + n < lengths)  # and earlier than the suffix itself
        starts[found] = first[found] + n
    return [[] if start < 0 else token_ids[r, start : min(start + num_drafts, int(lengths[r]))].tolist()
            for r, start in enumerate(starts.tolist())]
