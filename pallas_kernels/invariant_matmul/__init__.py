"""A matmul whose every output row is reduced in an order fixed by that row alone (Triton backend), and a gated
MLP's gate/up product with its activation in the same launch."""

from pallas_kernels.invariant_matmul.kernel import GATED_ACTIVATIONS, TILE, gated_invariant_matmul, invariant_matmul

__all__ = ["GATED_ACTIVATIONS", "TILE", "gated_invariant_matmul", "invariant_matmul"]
