"""Start-up compilation of the step's shape buckets, with a progress bar, and a guard against later compiles.

`compile_buckets="all"` runs the step once on padding-only inputs for every bucket the runner can produce (the
runner then pins the block-table width and ties a prefill step's query bound to its token bucket, so the set is
small); JAX's persistent compilation cache makes restarts cheap. `"lazy"` compiles a bucket on first use.

The buckets are first compiled ahead of time on several threads (XLA compiles without holding the GIL; a
32-layer 8B model takes seconds per bucket on a GPU host); the warm-up runs that follow find them compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from tqdm.auto import tqdm

from jengine.attention.metadata import AttentionMetadata
from jengine.runner.buckets import StepBuckets
from jengine.runner.step import num_compiled_shapes
from jengine.sampling.metadata import SamplingRowTable
from jengine.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

MAX_COMPILE_THREADS = 8  # each compile holds a copy of the program's HLO; 8 keep a 16-core host busy


@dataclasses.dataclass(frozen=True)
class StepShape:
    tokens: int
    seqs: int
    blocks: int
    query_len: int


def pinned_shapes(buckets: StepBuckets) -> list[StepShape]:
    """Every shape a pinned runner produces: decode-only steps (query length 1), one per request bucket, and mixed
    steps, one per token bucket."""
    width = buckets.blocks[-1]
    decode = [StepShape(min(t for t in buckets.tokens if t >= s), s, width, 1) for s in buckets.seqs]
    mixed = [StepShape(t, buckets.mixed_step_seqs(t), width, t) for t in buckets.tokens]
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


def warm_up(runner, shapes: list[StepShape], progress: bool = True) -> int:
    """Compiles the step for `shapes` (greedy and sampling variants of the sampler); returns the compile count."""
    calls = [_padding_step_inputs(runner, shape, sampled) for shape in shapes for sampled in (0, 1)]
    workers = min(MAX_COMPILE_THREADS, os.cpu_count() or 1)
    precompiled = workers > 1 and len(calls) > 1
    if precompiled:
        start, lowering, compiling = time.perf_counter(), 0.0, 0.0
        with ThreadPoolExecutor(workers) as pool, tqdm(total=len(calls), desc="Compiling step buckets",
                                                       disable=not progress) as bar:
            compile_one = functools.partial(_compile, runner)
            for lower_s, compile_s in pool.map(compile_one, calls):
                lowering, compiling = lowering + lower_s, compiling + compile_s
                bar.update()
        logger.info("compiled %d step variants on %d threads in %.1f s (summed over threads: tracing and lowering "
                    "%.1f s, XLA compile or cache load %.1f s)", len(calls), workers, time.perf_counter() - start,
                    lowering, compiling)
    before, start = num_compiled_shapes(), time.perf_counter()
    for inputs in tqdm(calls, desc="Warming up step buckets" if precompiled else "Compiling step buckets",
                       disable=not progress):
        _, _, runner.kv_cache, runner.row_tokens = runner._step(runner.params, runner.kv_cache, runner.row_tokens,
                                                                *inputs, num_prompt_logprobs=0)
    # The runs are dispatched asynchronously: wait for them here, or the first request would wait for them all.
    jax.block_until_ready((runner.kv_cache, runner.row_tokens))
    compiled = num_compiled_shapes() - before
    logger.info("%d step variants ready for %d shape buckets (warm-up runs %.1f s)", compiled, len(shapes),
                time.perf_counter() - start)
    return compiled


def _compile(runner, inputs: tuple) -> tuple[float, float]:
    return runner._compile_step(runner.params, runner.kv_cache, runner.row_tokens, *inputs, num_prompt_logprobs=0)


def _padding_step_inputs(runner, shape: StepShape, num_sampled: int) -> tuple:
    """The step's inputs after its state (params, cache, row tokens) for a padding-only step of `shape` that samples
    `num_sampled` rows (0: the greedy variant)."""
    table = SamplingRowTable(1)
    table.set_row(0, SamplingParams(temperature=1.0), 0, 0, ())
    token_ids, md, rows = padding_inputs(shape, runner.batch.num_slots)
    nowhere = np.full(shape.seqs, runner.row_tokens.shape[0], np.int32)  # samples recorded in no row
    sampled_rows = np.zeros(num_sampled, np.int64)
    sampling = table.build(sampled_rows, np.zeros(num_sampled, np.int64), None, shape.seqs)
    return token_ids, md, rows, nowhere, sampling, None, None


class RecompileGuard:
    """Warns, with the shape, whenever a step compiles after warm-up: steady state must not compile."""

    def __init__(self) -> None:
        self._count: int | None = None

    def arm(self) -> None:
        self._count = num_compiled_shapes()

    def check(self, describe) -> None:
        if self._count is None:
            return
        count = num_compiled_shapes()
        if count > self._count:
            logger.warning("the step compiled after warm-up (%s); this bucket was not precompiled", describe())
            self._count = count
