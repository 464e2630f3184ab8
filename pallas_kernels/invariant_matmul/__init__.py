"""A matmul whose every output row is reduced in an order fixed by that row alone (Triton backend)."""

from pallas_kernels.invariant_matmul.kernel import TILE, invariant_matmul

__all__ = ["TILE", "invariant_matmul"]
