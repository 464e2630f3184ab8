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


BACKENDS = {"reference": ReferenceBackend}


def select_backend(platform: str, requested: str = "auto") -> AttentionBackend:
    """`auto` picks the fastest backend the platform has; a named backend is taken as asked."""
    if requested != "auto":
        if requested not in BACKENDS:
            raise ValueError(f"unknown attention backend {requested!r}; available: {sorted(BACKENDS)}")
        return BACKENDS[requested]()
    backend = ReferenceBackend()
    logger.info("attention backend on %s: %s", platform, backend.name)
    return backend
