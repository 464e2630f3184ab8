"""Block sizes for the ragged paged attention kernel, kept apart from the kernel so tuning never touches its logic.

Two launches share one step: the *decode* kernel (requests whose new tokens fit in one small query tile, KV split
across programs, "flash decoding") and the *prefill* kernel (all other requests, one program per query tile and KV
head, the whole visible context in one program). Every block dimension is a power of two (Triton rule).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static launch parameters of one of the two kernels."""

    block_m: int  # query rows per program: tokens × (padded) query heads of one KV head
    block_n: int  # KV positions per inner-loop step
    num_warps: int
    num_stages: int  # Triton software-pipelining depth of the KV loop


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """Split-K of the decode kernel. A request's split count depends on its own visible length only
    (`clamp(ceil(len / split_tokens), 1, max_splits)`), never on the rest of the batch, so its reduction order
    (and therefore its result) is the same alone or in any batch."""

    split_tokens: int  # target KV positions per split (a multiple of the decode block_n)
    max_splits: int  # grid size along the split axis


@dataclasses.dataclass(frozen=True)
class Tuning:
    decode: KernelConfig
    prefill: KernelConfig
    split: SplitConfig


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def default_tuning(head_dim: int, group: int) -> Tuning:
    """The table: chosen on an H200 for Llama-3-8B-like shapes (32 q / 8 kv heads, d=128, bf16) by
    `scripts/bench_kernels.py` (sweep in `h200_sweep.json`); other shapes inherit it. `group` (query heads per KV
    head) sets the query rows: a decode tile packs all heads of one KV head.

    Why these (H200, 2026-11-29): decode is bandwidth-bound and wants many small programs (2 warps; chunks of 256
    positions: 8192 programs at batch 64 × 4k, 2048 at batch 8 × 32k); with 2 warps, block_n 16/32/64 were within
    1 % of each other, 4 warps or chunks of 512+ were 15-60 % slower on one of the two shapes. Prefill wants the
    biggest tiles Triton keeps in registers (128 × 128, 8 warps; 3 stages 3 % faster than 2).
    """
    group_pad = _next_pow2(group)
    decode_m = max(16, group_pad)
    prefill_m = max(128, group_pad)
    return Tuning(
        decode=KernelConfig(block_m=decode_m, block_n=64, num_warps=2, num_stages=3),
        prefill=KernelConfig(block_m=prefill_m, block_n=128, num_warps=8, num_stages=3),
        split=SplitConfig(split_tokens=256, max_splits=32),
    )
