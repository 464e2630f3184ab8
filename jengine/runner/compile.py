"""Start-up compilation of the step's shape buckets, with a progress bar, and a guard against later compiles.

`compile_buckets="all"` runs the step once on padding-only inputs for every bucket the runner can produce (the
runner then pins the block-table width and ties a prefill step's query bound to its token bucket, so the set is
small); JAX's persistent compilation cache makes restarts cheap. `"lazy"` compiles a bucket on first use.

The buckets are first compiled ahead of time on several threads (XLA compiles without holding the GIL; a
32-layer 8B model takes seconds per bucket on a GPU host); the warm-up runs that follow find them compiled.
This module plans the shapes and drives the compiles; the runner owns the step, its state and its padding inputs
(`ModelRunner.warm_up`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from jengine.attention.metadata import AttentionMetadata
from jengine.runner.buckets import StepBuckets
from jengine.runner.step import StepBatch, num_compiled_shapes
from jengine.progress import progress_bar

logger = logging.getLogger(__name__)

MAX_COMPILE_THREADS = 8  # each compile holds a copy of the program's HLO; 8 keep a 16-core host busy


@dataclasses.dataclass(frozen=True)
class StepShape:
    tokens: int
    seqs: int
    blocks: int
    query_len: int


def pinned_shapes(buckets: StepBuckets) -> list[StepShape]:
    """Every shape a pinned runner produces: decode-only steps (query length 1), one per request bucket and
    decode table width, and mixed steps, one per token bucket (whole tables)."""
    decode = [StepShape(min(t for t in buckets.tokens if t >= s), s, width, 1)
              for width in buckets.decode_blocks for s in buckets.seqs]
    mixed = [StepShape(t, buckets.mixed_step_seqs(t), buckets.blocks[-1], t) for t in buckets.tokens]
    return decode + mixed


def padding_inputs(shape: StepShape, num_slots: int) -> tuple[np.ndarray, AttentionMetadata, np.ndarray]:
    """A step that computes nothing: every token writes to the dropped slot, every request has length 0."""
    md = AttentionMetadata(
        positions=np.zeros(shape.tokens, np.int32),
        slot_mapping=np.full(shape.tokens, num_slots, np.int32),
        query_start_loc=np.zeros(shape.seqs + 1, np.int32),
        seq_lens=np.zeros(shape.seqs, np.int32),
        block_tables=np.zeros((shape.seqs, shape.blocks), np.int32),
        max_query_len=shape.query_len,
    )
    return np.zeros(shape.tokens, np.int32), md, np.zeros(shape.seqs, np.int32)


def warm_up(compile_one: Callable[[StepBatch], tuple[float, float]], run_one: Callable[[StepBatch], Any],
            batches: Sequence[StepBatch], num_shapes: int, progress: bool = True,
            compile_order: Sequence[StepBatch] | None = None) -> int:
    """Compiles the step for `batches` ahead of time on threads (`compile_one`, taking them in `compile_order`,
    default `batches`), then runs each once in order (`run_one`, which returns what to wait for); returns how many
    step programs the runs compiled."""
    precompiled = _precompile(compile_one, batches if compile_order is None else compile_order, progress)
    before, start = num_compiled_shapes(), time.perf_counter()
    pending = None
    for batch in progress_bar(batches, desc="Warming up step buckets" if precompiled else "Compiling step buckets",
                              enabled=progress):
        pending = run_one(batch)
    # The runs are dispatched asynchronously: wait for them here, or the first request would wait for them all.
    jax.block_until_ready(pending)
    compiled = num_compiled_shapes() - before
    logger.info("step programs of %d shape buckets warmed up (runs %.1f s; %d programs compiled by the runs)",
                num_shapes, time.perf_counter() - start, compiled)
    return compiled


def _precompile(compile_one: Callable[[StepBatch], tuple[float, float]], batches: Sequence[StepBatch],
                progress: bool) -> bool:
    """Compiles every batch's programs on a thread pool (nothing runs); False where one thread would do it all."""
    workers = min(MAX_COMPILE_THREADS, os.cpu_count() or 1)
    if workers <= 1 or len(batches) <= 1:
        return False
    start, lowering, compiling = time.perf_counter(), 0.0, 0.0
    with ThreadPoolExecutor(workers) as pool, progress_bar(total=len(batches), desc="Compiling step buckets",
                                                           enabled=progress) as bar:
        for lower_s, compile_s in pool.map(compile_one, batches):
            lowering, compiling = lowering + lower_s, compiling + compile_s
            bar.update()
    logger.info("compiled %d step variants on %d threads in %.1f s (summed over threads: tracing and lowering "
                "%.1f s, XLA compile or cache load %.1f s)", len(batches), workers, time.perf_counter() - start,
                lowering, compiling)
    return True


class RecompileGuard:
    """Warns, with the shape, whenever a step compiles after warm-up: steady state must not compile."""

    def __init__(self) -> None:
        self._count: int | None = None

    def arm(self) -> None:
        self._count = num_compiled_shapes()

    def check(self, describe: Callable[[], str]) -> None:
        if self._count is None:
            return
        count = num_compiled_shapes()
        if count > self._count:
            logger.warning("the step compiled after warm-up (%s); this bucket was not precompiled", describe())
            self._count = count
