"""Progress bars for terminals and notebooks only: redrawn into a log file or a pipe, each update would be a line."""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm


def progress_bar(*args: Any, enabled: bool = True, **kwargs: Any) -> tqdm:
    """tqdm, shown when `enabled` and the output is a terminal (tqdm's `disable=None`), silent otherwise."""
    return tqdm(*args, disable=None if enabled else True, **kwargs)
