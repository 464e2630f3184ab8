"""A MoE layer's expert stacks as the grouped-matmul kernels take them (`pallas_kernels/grouped_matmul`), launch by
launch: gate and up share one launch (and so one storage), down has its own.

Each launch reads its stacks as stored where the kernels can: float; 8-bit with one scale per (expert, output
column) (`column`) or per (expert, block) (`block`: DeepSeek/Qwen3-FP8's 128 × 128, group-wise int8); 4-bit words
with group scales and zero points (`int4`, `layers/quant4.py:Int4Experts`, GPTQ's activation order as gate/up's row
order). A block-scaled launch whose blocks are under 16 rows (a kernel's smallest K step) or cut by the tensor-
parallel split (gate/up by columns, down by rows) is dequantized to the activations' dtype in the step, as is a
launch whose two stacks differ, or a down launch whose blocks differ from gate/up's (the kernels take one block
shape a layer). So a checkpoint that keeps its down projections finer (GGUF's Q4_K_M) still reads gate/up packed.
"""

from __future__ import annotations

from typing import NamedTuple

from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from jengine.layers.quant import QuantizedWeight, column_scales, dequantize
from jengine.layers.quant4 import Int4Experts, dequantize4

MIN_BLOCK_ROWS = 16  # the kernels' smallest K step (one Triton dot's K)


class StackOperand(NamedTuple):
    """One stack as its launch reads it."""

    weight: Array
    scale: Array | None = None
    zero: Array | None = None
    kind: str = "float"  # float | column | block | int4
    block: tuple[int, int] | None = None  # (rows, columns) of each block scale ("block")


class ExpertOperands(NamedTuple):
    """The layer's three stacks (gate, up, down), gate/up's row order (4-bit activation order) and the block shape
    the kernels read (`scale_block`)."""

    gate: StackOperand
    up: StackOperand
    down: StackOperand
    perm: Array | None
    scale_block: tuple[int, int] | None

    @property
    def kind(self) -> str:
        """`gate/up's kind` where down's is the same, else `gate/up's+down's` (e.g. `int4+float`)."""
        return self.gate.kind if self.gate.kind == self.down.kind else f"{self.gate.kind}+{self.down.kind}"


def expert_float(w: Array | QuantizedWeight | Int4Experts, dtype) -> Array:
    """One expert stack for `ragged_dot`: 8-bit and 4-bit ones dequantized to `dtype`."""
    if isinstance(w, Int4Experts):
        return dequantize4(w, dtype)
    return dequantize(w, dtype) if isinstance(w, QuantizedWeight) else w


def stack_operand(stack, dtype, split: int, shards: int) -> StackOperand:
    """`stack` as stored where the kernels read it so on each of `shards` devices (`split`: the axis tensor
    parallelism cuts, -1 for gate/up's columns, -2 for down's rows), else dequantized."""
    if isinstance(stack, Int4Experts):
        return StackOperand(stack.packed, stack.scales, stack.zeros, "int4")
    if not isinstance(stack, QuantizedWeight):
        return StackOperand(stack)
    if (scale := column_scales(stack)) is not None:
        return StackOperand(stack.weight, scale, kind="column")
    rows, cols = stack.scheme.block_k, stack.scheme.block_n
    extent, block = stack.shape[split], (rows if split == -2 else cols)
    if rows % MIN_BLOCK_ROWS == 0 and (shards == 1 or extent % (shards * block) == 0):
        return StackOperand(stack.weight, stack.scale, kind="block", block=(rows, cols))
    return StackOperand(dequantize(stack, dtype))


def expert_operands(w: dict, dtype, shards: int = 1) -> ExpertOperands:
    """The layer's stacks (`we_gate`, `we_up`, `we_down`) launch by launch (see the module docstring)."""
    gate, up, down = (stack_operand(w[name], dtype, split, shards)
                      for name, split in (("we_gate", -1), ("we_up", -1), ("we_down", -2)))
    if (gate.kind, gate.block) != (up.kind, up.block):  # one launch reads both alike
        gate, up = StackOperand(expert_float(w["we_gate"], dtype)), StackOperand(expert_float(w["we_up"], dtype))
    block = gate.block or down.block
    if down.block is not None and down.block != block:  # one block shape a layer
        down = StackOperand(expert_float(w["we_down"], dtype))
    perm = w["we_gate"].perm if gate.kind == "int4" else None
    return ExpertOperands(gate, up, down, perm, block)


def kernel_weights(operands: ExpertOperands):
    """The kernels' `ExpertWeights` of these operands."""
    from pallas_kernels.grouped_matmul import ExpertWeights  # Pallas imported only where used

    g, u, d = operands.gate, operands.up, operands.down
    return ExpertWeights(g.weight, u.weight, d.weight, g.scale, u.scale, d.scale, g.zero, u.zero, d.zero,
                         operands.perm)


def kernel_weight_specs(operands: ExpertOperands, axis: str):
    """`kernel_weights`' partition specs under tensor parallelism over `axis`: gate/up by output columns, down by
    input rows; their scales and zero points alike (a column scale of down's replicated), the row order replicated."""
    from pallas_kernels.grouped_matmul import ExpertWeights

    cols, rows = P(None, None, axis), P(None, axis, None)

    def scale_spec(op: StackOperand, spec: P) -> P | None:
        if op.scale is None:
            return None
        if op.kind == "column":
            return P(None, axis) if spec is cols else P()
        return spec

    g, u, d = operands.gate, operands.up, operands.down
    return ExpertWeights(cols, cols, rows, scale_spec(g, cols), scale_spec(u, cols), scale_spec(d, rows),
                         None if g.zero is None else cols, None if u.zero is None else cols,
                         None if d.zero is None else rows, None if operands.perm is None else P())
