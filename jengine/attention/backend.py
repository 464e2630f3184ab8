"""One attention signature, several implementations; the engine picks one per platform, once, at start-up."""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from jaxtyping import Array, Float, Int

from jengine.attention import reference
from jengine.attention.metadata import AttentionMetadata
from jengine.attention.reference import KVCache
from jengine.errors import ConfigError

logger = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    """Writes this step's K/V into the paged cache, then attends over it.

    Implementations may fuse the write into the attention kernel; the cache comes back updated (it is donated).
    `kv_cache` is the paged array or, for `kv_cache_dtype="fp8"`, a `kv_cache.QuantizedKV` (float8 pages + per-layer,
    per-KV-head scales, already set for `layer` by the attention layer): writes quantize with those scales, reads
    dequantize, and the scales come back unchanged. A backend may also carry `experts`, the platform's MoE kernels
    (`jengine.layers.mlp.PallasExperts`); without it MoE layers run their experts as XLA `ragged_dot`.
    """

    name: str

    def __call__(
        self,
        q: Float[Array, "tokens q_heads head_dim"],
        k: Float[Array, "tokens kv_heads head_dim"],
        v: Float[Array, "tokens kv_heads head_dim"],
        kv_cache: KVCache,
        layer: Int[Array, ""],
        md: AttentionMetadata,
        *,
        scale: float,
        sliding_window: Int[Array, ""] | int,
        soft_cap: float | None,
    ) -> tuple[Float[Array, "tokens q_heads head_dim"], KVCache]: ...

    def one_split_positions(self, quantized: bool) -> int | None:
        """Block-table positions up to which a decode-only step's attention needs no merge launch after its split
        programs (the runner gives such steps a table that narrow: `StepBuckets.decode_blocks`); None where no
        table width needs one. `quantized`: a float8 cache."""
        ...


@dataclasses.dataclass(frozen=True)
class ReferenceBackend:
    """Pure jnp: XLA scatter for the write, gather + dense softmax for the attention. Runs anywhere."""

    name: str = "reference"

    def __call__(self, q, k, v, kv_cache, layer, md, *, scale, sliding_window, soft_cap):
        kv_cache = reference.write_kv(kv_cache, layer, md.slot_mapping, k, v)
        out = reference.paged_attention(
            q, kv_cache, layer, md, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap
        )
        return out, kv_cache

    def one_split_positions(self, quantized: bool) -> int | None:
        return None  # one dense computation at every width


def _pallas_gpu(mesh=None) -> AttentionBackend:
    from jengine.attention.pallas import PallasGpuBackend  # imports Pallas only where it is used

    return PallasGpuBackend(mesh=mesh)


def _reference(mesh=None) -> AttentionBackend:
    return ReferenceBackend()  # plain jnp: GSPMD partitions it from the cache's sharding


BACKENDS = {"reference": _reference, "pallas_gpu": _pallas_gpu}


def select_backend(platform: str, requested: str = "auto", head_dim: int | None = None, *,
                   mesh=None, deterministic: bool = False, max_model_len: int | None = None) -> AttentionBackend:
    """`auto` picks the fastest backend the platform has; a named backend is taken as asked. On the GPU the Pallas
    kernels serve head_dim 64/128 (unknown head_dim: the backend itself falls back at trace time); others get the
    reference, with a log line saying why. `mesh`: the engine's tensor-parallel mesh (kernels run per device).
    `deterministic`: a row's attention arithmetic the same whatever its batch (`--deterministic`), its long
    contexts in segments sized for `max_model_len` (`invariant_segment`)."""
    if requested != "auto":
        if requested not in BACKENDS:
            raise ValueError(f"unknown attention backend {requested!r}; available: {sorted(BACKENDS)}")
        backend = BACKENDS[requested](mesh)
    else:
        backend = _fastest(platform, head_dim, mesh)
    return _deterministic(backend, platform, max_model_len) if deterministic else backend


def _fastest(platform: str, head_dim: int | None, mesh) -> AttentionBackend:
    backend = ReferenceBackend()
    if platform == "gpu":
        from pallas_kernels.ragged_paged_attention import SUPPORTED_HEAD_DIMS

        if head_dim is None or head_dim in SUPPORTED_HEAD_DIMS:
            backend = _pallas_gpu(mesh)
        else:
            logger.warning("pallas_gpu attention supports head_dim %s, not %d: using reference", SUPPORTED_HEAD_DIMS,
                           head_dim)
    logger.info("attention backend on %s: %s", platform, backend.name)
    return backend


def has_invariant_path(backend: AttentionBackend) -> bool:
    """Whether the backend has a batch-invariant attention mode (`deterministic`)."""
    return dataclasses.is_dataclass(backend) and any(f.name == "invariant" for f in dataclasses.fields(backend))


# The batch-invariant attention's long-context segments (`Tuning.invariant_segment`; None: one split): at least
# INVARIANT_SEGMENT positions, and few enough that `max_model_len` spans at most MAX_INVARIANT_SEGMENTS of them (the
# decode grid's split axis and its partial outputs grow with the segments a block table can cross, as the fast
# decode's `max_splits` bounds its own). Segments of 2048 brought a deterministic batch-1 32k-context decode step
# from 3.9x the fast one's to 0.99x (benchmarks/results/2026-12-06-*-segment2048-b9302db.json); 512 keeps every bit
# check equal on an H100 (`scripts/check_invariant_attention_gpu.py --segment 512 --split 2048`,
# results/2026-12-07-invariant-attention-13bb250.json, where its decode steps also ran 1.1-1.7x faster than one
# split) and, with a short step's segments apart, took a prefix-cache hit's TTFT from 13.02 to 11.75 ms (device
# step 8.34 to 7.64 ms) at an unchanged batch-256 decode (results/2026-12-07-e2e-engine-seg512-3813d61.json).
INVARIANT_SEGMENT: int | None = 512
MAX_INVARIANT_SEGMENTS = 16
# The positions one batch-invariant decode program walks (`Tuning.invariant_split`): whole segments, at least one.
# Segments finer than this spread a short step's prefill (a prefix-cache hit) over more programs while decode steps
# keep their launches: a table of at most this many positions still decodes in one kernel, no merge.
INVARIANT_SPLIT = 2048
# A short step's segments on programs of their own and a merge launch (`Tuning.parallel_short_segments`): bitwise the
# rows of the one-program walk (interpret mode, and an H100 at 13bb250); timed end to end as above
SHORT_STEP_SEGMENTS_APART = True


def invariant_segment_for(max_model_len: int | None) -> int | None:
    """The segment of an engine serving `max_model_len` positions: INVARIANT_SEGMENT, doubled until the context
    spans at most MAX_INVARIANT_SEGMENTS (fixed for the engine's life, as its rows' bits require; whole prefill KV
    tiles, which `Tuning.batch_invariant` checks)."""
    if not INVARIANT_SEGMENT:
        return None
    segment = INVARIANT_SEGMENT
    while max_model_len and -(-max_model_len // segment) > MAX_INVARIANT_SEGMENTS:
        segment *= 2
    return segment


def invariant_split_for(segment: int | None) -> int | None:
    """A decode program's chunk for `segment`: INVARIANT_SPLIT rounded up to whole segments, at least one."""
    if not segment:
        return None
    return max(segment, -(-INVARIANT_SPLIT // segment) * segment)


def _deterministic(backend: AttentionBackend, platform: str, max_model_len: int | None = None) -> AttentionBackend:
    """The backend in its batch-invariant mode. The reference attention keeps a row's result on the CPU
    whatever the batch (the engine's tests hold it); on a GPU its XLA reductions follow the shape, so it is refused
    rather than served as deterministic."""
    if has_invariant_path(backend):
        fold = invariant_segment_for(max_model_len)
        segment = ({"invariant_segment": fold, "invariant_split": invariant_split_for(fold),
                    "parallel_short_segments": SHORT_STEP_SEGMENTS_APART}
                   if hasattr(backend, "invariant_segment") else {})
        return dataclasses.replace(backend, invariant=True, **segment)
    if platform != "cpu":
        raise ConfigError(f"deterministic=True needs the pallas_gpu attention backend on {platform} ({backend.name} "
                          "attention is not batch-invariant there; pallas_gpu serves head_dim 64 and 128)")
    return backend
