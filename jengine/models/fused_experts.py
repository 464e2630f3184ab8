"""Expert stacks as transformers 5 saves them, read under the per-expert names hub checkpoints use.

`save_pretrained` of a transformers-5 MoE model (`save_original_format=False`, and some newer hub repositories)
writes each layer's experts as two stacked tensors: `mlp.experts.gate_up_proj [E, 2·I, H]` (each expert's gate rows,
then its up rows) and `mlp.experts.down_proj [E, H, I]`, and Mixtral's router as `mlp.gate.weight`. Every expert's
gate, up and down weights are contiguous byte ranges of those stacks, so they are offered as per-expert tensors
(`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`, ...) pointing into the same
file: nothing is copied. A stack in another orientation is refused by name.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, Protocol

from jengine.errors import CheckpointError

_FUSED = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.gate_up_proj")


class _Info(Protocol):  # `checkpoint.TensorInfo`
    shape: tuple[int, ...]
    start: int
    end: int


def has_fused_experts(names) -> bool:
    return any(_FUSED.fullmatch(name) for name in names)


def per_expert_names(tensors: dict[str, _Info], config: Callable[[], dict[str, Any]]) -> dict[str, _Info]:
    """`tensors` with every fused expert stack replaced by per-expert views (`config()`: the model's config.json,
    read for its hidden size and, for Mixtral, its names)."""
    hf = config()
    hidden, mixtral = int(hf["hidden_size"]), hf.get("model_type") == "mixtral"
    out = dict(tensors)
    for name in tensors:
        match = _FUSED.fullmatch(name)
        if match is None:
            continue
        layer = match.group(1)
        gate_up, down = out.pop(name), out.pop(f"{layer}.mlp.experts.down_proj", None)
        if down is None:
            raise CheckpointError(f"{name} has no {layer}.mlp.experts.down_proj beside it")
        experts, inter = _check(name, gate_up, down, hidden)
        base, (gate, up, down_name) = ((f"{layer}.block_sparse_moe", ("w1", "w3", "w2")) if mixtral
                                       else (f"{layer}.mlp", ("gate_proj", "up_proj", "down_proj")))
        if mixtral and f"{layer}.mlp.gate.weight" in out:
            out[f"{base}.gate.weight"] = out.pop(f"{layer}.mlp.gate.weight")
        for e in range(experts):
            both = _row_block(gate_up, e, 2 * inter, hidden)
            out[f"{base}.experts.{e}.{gate}.weight"] = _rows(both, 0, inter, hidden)
            out[f"{base}.experts.{e}.{up}.weight"] = _rows(both, inter, inter, hidden)
            out[f"{base}.experts.{e}.{down_name}.weight"] = _row_block(down, e, hidden, inter)
    return out


def _check(name: str, gate_up: _Info, down: _Info, hidden: int) -> tuple[int, int]:
    """(experts, intermediate size) of a layer's stacks in the orientation read here."""
    if len(gate_up.shape) != 3 or gate_up.shape[2] != hidden or gate_up.shape[1] % 2:
        raise CheckpointError(f"{name} has shape {gate_up.shape}; expert stacks are read as [experts, 2 x "
                              f"intermediate, hidden ({hidden})]")
    experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if tuple(down.shape) != (experts, hidden, inter):
        raise CheckpointError(f"{name.replace('gate_up_proj', 'down_proj')} has shape {down.shape}; expected "
                              f"{(experts, hidden, inter)} beside gate_up_proj {gate_up.shape}")
    return experts, inter


def _row_block(info: _Info, index: int, rows: int, cols: int) -> _Info:
    """Entry `index` of a stack of `[rows, cols]` matrices."""
    size = (info.end - info.start) // info.shape[0]
    start = info.start + index * size
    return dataclasses.replace(info, shape=(rows, cols), start=start, end=start + size)


def _rows(info: _Info, first: int, count: int, cols: int) -> _Info:
    """Rows `first … first + count` of a `[rows, cols]` matrix."""
    row_bytes = (info.end - info.start) // info.shape[0]
    start = info.start + first * row_bytes
    return dataclasses.replace(info, shape=(count, cols), start=start, end=start + count * row_bytes)
