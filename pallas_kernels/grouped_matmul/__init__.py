"""Grouped matmuls for mixture-of-experts layers: routing layout, Triton-backend kernels, one entry point."""

from pallas_kernels.grouped_matmul.moe import ExpertWeights, moe_experts, tile_configs
from pallas_kernels.grouped_matmul.kernel import Scaling, TileConfig
from pallas_kernels.grouped_matmul.routing import ExpertTiles, combine, expert_tiles

__all__ = ["ExpertTiles", "ExpertWeights", "Scaling", "TileConfig", "combine", "expert_tiles", "moe_experts",
           "tile_configs"]
