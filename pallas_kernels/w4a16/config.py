"""How the W4A16 matmul is tiled: which path (`gemv`, `dot`, `dequant`) and its blocks, per call shape.

- `gemv` (few rows, decode): float32 multiply-adds on the CUDA cores, one group of 128 input rows (16 words) per
  loop step, the columns in wide strips so each row of words is one coalesced load, K split across programs
  (partial sums in float32, added by XLA) until the grid fills the GPU.
- `dot` (tens of rows and up): each step dequantizes a `block_k × block_n` bfloat16 tile in registers and feeds it
  to the tensor cores; K split as above when the grid would be too small.
- `dequant` (prefill-sized row counts): one XLA fusion writes the dequantized weight, cuBLAS multiplies — the
  weight's extra read and write cost less than a matmul whose dequantization is repeated for every row tile (the
  same switch vLLM's AWQ makes from 256 tokens up).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Method = Literal["gemv", "dot", "dequant"]
H200_SMS = 132


@dataclasses.dataclass(frozen=True)
class W4A16Config:
    """`block_n`/`block_m` are upper bounds: the largest power of two dividing the shape is used. `min_programs`:
    split K (over whole groups) until the grid has at least this many programs; 0 never splits."""

    method: Method = "gemv"
    block_m: int = 16
    block_n: int = 256
    block_k: int = 128
    min_programs: int = 2 * H200_SMS
    num_warps: int = 4
    num_stages: int = 2
    prefetch: bool = False  # gemv: load the next group's words before using the current one
    planes: bool = False  # dot: 8 dots of one nibble plane each instead of one dot of the merged tile

    def label(self) -> str:
        if self.method == "dequant":
            return "dequant"
        tail = ("+pf" if self.prefetch else "") + ("+planes" if self.planes else "")
        return (f"{self.method} m{self.block_m} n{self.block_n} k{self.block_k} p{self.min_programs} "
                f"w{self.num_warps} s{self.num_stages}{tail}")


GEMV_MAX_ROWS = 4  # the gemv path keeps one accumulator tile per row
DOT_MAX_ROWS = 256  # beyond this, `dequant` (see the module docstring)


def default_config(rows: int) -> W4A16Config:
    """The configuration for `rows` tokens (static, so a token bucket always takes the same arithmetic)."""
    if rows <= GEMV_MAX_ROWS:
        return W4A16Config("gemv", block_m=rows, block_n=256, num_warps=4, num_stages=2)
    if rows <= DOT_MAX_ROWS:
        return W4A16Config("dot", block_m=min(pow2_at_least(rows), 64), block_n=128, block_k=128,
                           num_warps=4, num_stages=3)
    return W4A16Config("dequant")


def pow2_at_least(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def column_block(n: int, limit: int) -> int:
    """The largest power of two ≤ `limit` dividing `n` (at least 16); ValueError when none does."""
    block = limit
    while block >= 16:
        if n % block == 0:
            return block
        block //= 2
    raise ValueError(f"the W4A16 kernel needs the output features ({n}) to be a multiple of 16")


def k_splits(groups: int, column_programs: int, min_programs: int) -> int:
    """The fewest splits of `groups` (a divisor of it) giving at least `min_programs` programs in all."""
    for split in range(1, groups + 1):
        if groups % split == 0 and split * column_programs >= min_programs:
            return split
    return groups
