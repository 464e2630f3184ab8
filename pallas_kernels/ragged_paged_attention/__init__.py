"""Ragged paged attention over a flattened batch of prefill chunks and decodes (Pallas, Triton backend)."""

from pallas_kernels.ragged_paged_attention.kernel import (
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_DIMS,
    UnsupportedShapeError,
    check_supported,
    ragged_paged_attention,
)

__all__ = [
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_HEAD_DIMS",
    "UnsupportedShapeError",
    "check_supported",
    "ragged_paged_attention",
]
