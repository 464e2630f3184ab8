"""Block sizes for the ragged paged attention kernel, kept apart from the kernel so tuning never touches its logic.

Two launches share one step: the *decode* kernel (requests whose new tokens fit in one small query tile, KV split
across programs, "flash decoding") and the *prefill* kernel (all other requests, one program per query tile and KV
head, the whole visible context in one program). `default_tuning` is the table; `Tuning.batch_invariant` adapts it
to the batch-invariant mode and a step's static shapes. Every block dimension is a power of two (Triton rule).
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.addressing import next_pow2


SMALL_STEP_ROWS = 512  # query rows (tokens × padded heads of one KV head) up to which a step's tiles are small
DECODE_SPLIT_TOKENS = 512  # the fast decode's positions a split (`default_tuning`): 16-bit cache
FP8_DECODE_SPLIT_TOKENS = 1024  # and float8 cache
# The batch-invariant mode's short-step prefill tiles (`Tuning.short_prefill`, 16-bit cache): 32 rows, 4 warps. On a
# prefix-cache hit's step (64 new tokens over 2,112 positions, 8B heads; one H100, e0c7543,
# `scripts/probe_attention_loop_gpu.py`) 41.4 µs a layer against 48.6 for the decode kernel's 16-row tiles, bitwise
# the same rows; 64 rows were slower (59.9-69.6 µs)
SHORT_PREFILL_ROWS = 32


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static launch parameters of one of the two kernels."""

    block_m: int  # query rows per program: tokens × (padded) query heads of one KV head
    block_n: int  # KV positions per inner-loop step
    num_warps: int
    num_stages: int  # Triton software-pipelining depth of the KV loop
    prefetch_pages: bool = False  # the loop reads the next KV step's page ids during this one (`tiles.KVSource`)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Launch parameters of the Mosaic GPU prefill kernel (`mosaic_prefill.py`)."""

    block_kv: int = 128  # KV positions a step (a multiple of 64 and of the cache's block size)
    max_concurrent_steps: int = 2  # shared-memory ring depth of the K/V loads
    staged_pv: bool = False  # P V from P in shared memory into a fresh accumulator (the interpreter's form)
    # One program per SM taking (head, tile) items in turn, its producer loading the next item's first steps while
    # the compute groups finish the last one; False: one program per item
    persistent: bool = False


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    """Launch parameters of the Mosaic GPU decode (`mosaic_decode.py`): `block_kv` positions a step (whole pages, a
    multiple of 64), `slots` steps in the ring (`slots - 1` in flight while one is computed), `split` positions a
    program walks (whole steps; a sequence's splits are merged after); `prefetch_pages`: a step reads the page ids
    of the load after the one it issues, so their latency overlaps its computation instead of preceding a load."""

    block_kv: int = 64
    slots: int = 3
    split: int = 2048
    prefetch_pages: bool = False


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """Split-K of the decode kernel. A request's split count depends on its own visible length only
    (`clamp(ceil(len / split_tokens), 1, max_splits)`), never on the rest of the batch, so its reduction order
    (and therefore its result) is the same alone or in any batch."""

    split_tokens: int  # target KV positions per split (a multiple of the decode block_n)
    max_splits: int  # grid size along the split axis
    # `absolute`: the splits are the chunks [j·split_tokens, (j+1)·split_tokens) of the positions from 0, as many as
    # a context crosses (`max_splits` then bounds them for the step's block table): the batch-invariant mode's
    # long-context split, which the prefill kernel reproduces row by row (`Tuning.invariant_segment`)
    absolute: bool = False
    # With `absolute`: the positions folded as one partial result (`tiles.attend_in_segments`), a divisor of
    # `split_tokens` (0: `split_tokens`); a split program walks its chunk's segments one after another
    segment: int = 0

    @property
    def fold(self) -> int:
        """The absolute mode's segment: what a row's arithmetic is cut at, whichever program walks it."""
        return self.segment or self.split_tokens

    @property
    def slots(self) -> int:
        """Partial results a request's context may leave: one a segment in the absolute mode, else one a split."""
        return self.max_splits * (self.split_tokens // self.fold) if self.absolute else self.max_splits


@dataclasses.dataclass(frozen=True)
class Tuning:
    decode: KernelConfig
    prefill: KernelConfig
    split: SplitConfig
    fp8_operands: str = "bfloat16"  # a float8 cache's tensor-core operands: "bfloat16" or "float16" (`Scores`)
    # The batch-invariant mode's long contexts: None, one split (a batch-1 32k context then walks on one program a
    # KV head); or segments of this many positions (a multiple of the prefill tile's KV width) whose partial
    # results are folded in order by every kernel alike, so the rows stay bitwise the same
    invariant_segment: int | None = None
    # The positions one decode program walks in that mode (a multiple of `invariant_segment`; None: one segment):
    # fine segments for the arithmetic, chunks of several for the decode's launches
    invariant_split: int | None = None
    # The batch-invariant mode's prefill tiles for a short step (`batch_invariant`); None: the decode kernel's
    short_prefill: KernelConfig | None = None
    # The prefill kernel's segments (`invariant_segment`) on programs of their own, then folded by a merge launch
    # (`kernel._prefill_segments_call`): set by `batch_invariant` for a short step whose table spans several segments,
    # where `parallel_short_segments` allows it, so a few new tokens over a long cached context (a prefix-cache hit)
    # walk one segment a program, not all of them
    segments_apart: bool = False
    parallel_short_segments: bool = False
    # The requests with at least 64 new tokens on the Mosaic GPU prefill kernel (`mosaic_prefill.py`) outside the
    # batch-invariant mode; None: the Triton prefill kernel serves every prefill row
    mosaic_prefill: MosaicConfig | None = None
    # Decode-only steps of one new token a request on the Mosaic GPU decode (`mosaic_decode.py`) outside the
    # batch-invariant mode, for 16-bit and float8 caches without a soft cap; None: the Triton decode kernel
    mosaic_decode: MosaicDecodeConfig | None = None

    def __post_init__(self):
        if self.fp8_operands not in ("bfloat16", "float16"):
            raise ValueError(f"fp8_operands={self.fp8_operands!r}: bfloat16 or float16")

    def batch_invariant(self, max_query_len: int, group_pad: int, table_positions: int) -> Tuning:
        """The tuning of the batch-invariant mode: short requests still go to the decode kernel, but in one split
        and walking KV tiles as wide as the prefill kernel's, so each row adds up the same tiles in the same order
        in either kernel (their row sums then also go through the tensor cores: `Scores.sums_by_mma`). One split
        also measured faster than split-K where the grid is full (an H100, 7615561: 380 against 394 µs at 64
        requests × 4k, 228 against 250 at 256 × 576; 618 against 386 at 8 × 32k).

        A step whose requests have few new tokens (at most SMALL_STEP_ROWS query rows of one KV head) gives the
        prefill kernel the same tiles (or `short_prefill`'s), so a short chunk over a long context (a prefix-cache
        hit) spreads over many programs instead of walking its context in two: a row's arithmetic does not depend
        on its tile's rows here (checked on an H100 in `scripts/check_invariant_attention_gpu.py`), where the
        default's row sums follow the tile's register layout, which a step's bucket would then choose.
        `table_positions` (the step's block-table width in positions) bounds the splits of `invariant_segment`;
        a short step whose table spans several of them walks them apart (`segments_apart`) where
        `parallel_short_segments` allows it."""
        decode = dataclasses.replace(self.decode, block_n=self.prefill.block_n)
        small = decode if self.short_prefill is None else dataclasses.replace(self.short_prefill,
                                                                               block_n=self.prefill.block_n)
        short = max_query_len * group_pad <= SMALL_STEP_ROWS
        split = SplitConfig(split_tokens=decode.block_n, max_splits=1)
        if self.invariant_segment:
            segment, chunk = self.invariant_segment, self.invariant_split or self.invariant_segment
            if segment % decode.block_n:
                raise ValueError(f"invariant_segment={segment}: a multiple of {decode.block_n}")
            if chunk % segment:
                raise ValueError(f"invariant_split={chunk}: a multiple of invariant_segment={segment}")
            split = SplitConfig(split_tokens=chunk, absolute=True, segment=segment,
                                max_splits=-(-table_positions // chunk))  # chunks it can cross
        apart = self.parallel_short_segments and short and split.absolute and -(-table_positions // split.fold) > 1
        return dataclasses.replace(self, decode=decode, prefill=small if short else self.prefill, split=split,
                                   segments_apart=apart)


# The Mosaic GPU decode for a Hopper GPU's decode-only steps; None until `scripts/bench_kernels.py --only peers` has
# timed it beside the Triton decode (`decode_*_mosaic_vs_ours`) and the engine end to end
MOSAIC_DECODE_ON_HOPPER: MosaicDecodeConfig | None = None


def default_tuning(head_dim: int, group: int, quantized: bool = False, hopper: bool = False) -> Tuning:
    """The table: chosen on an H200 for Llama-3-8B-like shapes (32 q / 8 kv heads, d=128, bf16) by
    `scripts/bench_kernels.py` (sweeps in `h200_sweep.json` and benchmarks/results/2026-12-01-decode_probes.json);
    other shapes inherit it. `group` (query heads per KV
    head) sets the query rows: a decode tile packs all heads of one KV head; `quantized`: a float8 cache; `hopper`:
    the device has wgmma (sm_90), so a 16-bit cache's long prefill rows take the Mosaic GPU kernel.

    Why these (H200, 2026-12-01, benchmarks/results/2026-12-01-kernels.json): decode is bound by the latency of
    its block-table-addressed loads (page order made no difference; Triton's pipeliner waits for every copy at the
    top of each iteration), and wants 4 warps with chunks of 512 positions for bf16 (274 / 262 µs at batch 64 × 4k
    / 8 × 32k, against 290 / 275 µs for 2 warps and chunks of 256) and chunks of 1024 with 3 stages for float8
    (230 / 238 µs, against 249 / 242 µs). Prefill wants the biggest tiles Triton keeps in registers (128 × 128,
    8 warps; 3 stages 3 % faster than 2). A float8 cache's tensor cores take float16 operands (e4m3 converts to
    float16 in one instruction a byte pair; an H100, 2d9a43c: 208.8 against 232.5 µs at batch 64 × 4k, 199.3
    against 234.9 at 8 × 32k, `benchmarks/results/2026-12-06-kernels-fp8-sweep-2d9a43c.json`). The Mosaic GPU
    prefill wants 128-position KV steps in a ring of three slots (4k causal: 322 µs = 427 TFLOP/s, against 355 µs
    with two slots, 389 with 64-position steps, 401 with P staged through shared memory, 510 for the Triton prefill;
    an H100, `benchmarks/results/2026-12-07-mosaic-prefill-8839aef.json` and `-9c2baf2.json`); persistent programs
    gained nothing (`-d741449.json`).
    """
    group_pad = next_pow2(group)
    decode_m = max(16, group_pad)
    prefill_m = max(128, group_pad)
    prefill = KernelConfig(block_m=prefill_m, block_n=128, num_warps=8, num_stages=3)
    if quantized:
        return Tuning(decode=KernelConfig(block_m=decode_m, block_n=64, num_warps=4, num_stages=3), prefill=prefill,
                      split=SplitConfig(split_tokens=FP8_DECODE_SPLIT_TOKENS, max_splits=8), fp8_operands="float16",
                      mosaic_decode=MOSAIC_DECODE_ON_HOPPER if hopper else None)
    return Tuning(
        decode=KernelConfig(block_m=decode_m, block_n=64, num_warps=4, num_stages=2),
        prefill=prefill,
        split=SplitConfig(split_tokens=DECODE_SPLIT_TOKENS, max_splits=16),
        short_prefill=KernelConfig(block_m=max(SHORT_PREFILL_ROWS, group_pad), block_n=prefill.block_n,
                                   num_warps=4, num_stages=2),
        mosaic_prefill=MosaicConfig(block_kv=128, max_concurrent_steps=3) if hopper else None,
        mosaic_decode=MOSAIC_DECODE_ON_HOPPER if hopper else None,
    )
