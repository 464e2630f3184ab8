"""Matmuls of activations by 8-bit weights (float8 or int8) with one scale per output column (Triton backend)."""

from pallas_kernels.quant_matmul.config import FewTokenConfig
from pallas_kernels.quant_matmul.kernel import few_token_matmul
from pallas_kernels.quant_matmul.reference import few_token_matmul_reference

__all__ = ["FewTokenConfig", "few_token_matmul", "few_token_matmul_reference"]
