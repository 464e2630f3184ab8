"""One attention signature, several implementations; the engine picks one per platform, once, at start-up."""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from jaxtyping import Array, Float, Int

from jengine.attention import reference
from jengine.attention.metadata import AttentionMetadata
from jengine.attention.reference import KVCache

logger = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    """Writes this step's K/V into the paged cache, then attends over it.

    Implementations may fuse the write into the attention kernel; the cache comes back updated (it is donated).
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


def _pallas_gpu() -> AttentionBackend:
    from jengine.attention.pallas import PallasGpuBackend  # imports Pallas only where it is used

    return PallasGpuBackend()


BACKENDS = {"reference": ReferenceBackend, "pallas_gpu": _pallas_gpu}


def select_backend(platform: str, requested: str = "auto", head_dim: int | None = None) -> AttentionBackend:
    """`auto` picks the fastest backend the platform has; a named backend is taken as asked. On the GPU the Pallas
    kernels serve head_dim 64/128 (unknown head_dim: the backend itself falls back at trace time); others get the
    reference, with a log line saying why."""
    if requested != "auto":
        if requested not in BACKENDS:
            raise ValueError(f"unknown attention backend {requested!r}; available: {sorted(BACKENDS)}")
        return BACKENDS[requested]()
    backend = ReferenceBackend()
    if platform == "gpu":
        from pallas_kernels.ragged_paged_attention import SUPPORTED_HEAD_DIMS

        if head_dim is None or head_dim in SUPPORTED_HEAD_DIMS:
            backend = _pallas_gpu()
        else:
            logger.warning("pallas_gpu attention supports head_dim %s, not %d: using reference", SUPPORTED_HEAD_DIMS,
                           head_dim)
    logger.info("attention backend on %s: %s", platform, backend.name)
    return backend
