"""W4A16 matmul: 4-bit weights with group zero points and scales, dequantized in registers (Triton)."""

from pallas_kernels.w4a16.config import W4A16Config, default_config
from pallas_kernels.w4a16.kernel import w4a16_matmul
from pallas_kernels.w4a16.reference import unpack, w4a16_matmul_reference

__all__ = ["W4A16Config", "default_config", "unpack", "w4a16_matmul", "w4a16_matmul_reference"]
