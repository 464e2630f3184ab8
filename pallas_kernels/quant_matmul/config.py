"""How the 8-bit few-row matmul is tiled, and how far K is split so the grid fills the GPU."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FewTokenConfig:
    """Tiles of `few_token_matmul`. `min_programs`: split K until the grid has at least this many programs
    (0: never split); the split is computed per weight shape (`k_splits`)."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    min_programs: int = 0

    def label(self) -> str:
        return f"n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages} p{self.min_programs}"

    def kernel_args(self, n: int, k: int) -> dict:
        return dict(block_n=self.block_n, block_k=self.block_k, num_warps=self.num_warps,
                    num_stages=self.num_stages, k_splits=k_splits(n, k, self))


def k_splits(n: int, k: int, config: FewTokenConfig) -> int:
    """The fewest K splits giving `config.min_programs` programs for an `[n, k]` weight (at most one per K step)."""
    column_programs = -(-n // config.block_n)
    steps = -(-k // config.block_k)
    if config.min_programs <= column_programs:
        return 1
    return min(steps, -(-config.min_programs // column_programs))
