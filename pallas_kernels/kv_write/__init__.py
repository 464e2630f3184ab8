"""Writes this step's K/V into their cache slots in place (Pallas, Triton backend)."""

from pallas_kernels.kv_write.kernel import write_kv

__all__ = ["write_kv"]
