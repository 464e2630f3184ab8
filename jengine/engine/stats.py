"""What the engine reports about itself: plain data the core builds and every front end and server reads."""

from __future__ import annotations

import bisect
import dataclasses


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Upper bounds of the tokens-per-engine-step histogram (vLLM's `iteration_tokens_total` buckets)."""


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state, published by the core thread after each step (safe to read anywhere).

    Gauges and cumulative counters with vLLM's meanings; servers turn them into Prometheus metrics at scrape time.
    """

    num_running: int = 0  # requests (choices) in the running batch
    num_waiting: int = 0  # admitted, waiting for their first (or a resumed) scheduling
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by requests, 0..1 (cached free blocks are free)
    num_preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # cumulative of those served from it
    num_gpu_blocks: int = 0  # size of the KV pool in blocks (0 where unknown)
    block_size: int = 0  # tokens per KV block (0 where unknown)
    # Engine steps by tokens computed in the step: one count per bucket of ITERATION_TOKEN_BUCKETS plus one above the
    # last (not cumulative); () where the engine does not report them (a remote engine over gRPC).
    step_token_counts: tuple[int, ...] = ()
    step_tokens_sum: int = 0  # cumulative tokens of those steps
    max_loras: int = 0  # LoRA device slots (0: LoRA not enabled)
    running_loras: tuple[str, ...] = ()  # adapters of the running requests, sorted
    waiting_loras: tuple[str, ...] = ()  # adapters of the waiting requests, sorted
    # Speculative decoding, cumulative (vLLM's spec_decode_* counters): proposals verified, their draft tokens,
    # the accepted ones, and per draft position how many were accepted
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()


class StepTokenCounts:
    """Cumulative histogram of the tokens each executed step computed (prefill chunks and decodes together)."""

    def __init__(self) -> None:
        self.counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)  # per bucket, the last one above every bound
        self.total_tokens = 0

    def add(self, num_tokens: int) -> None:
        self.counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self.total_tokens += num_tokens
