"""One table of PartitionSpec rules by parameter name, and the layout of one engine on its mesh.

Megatron-style tensor parallelism over the `tp` axis: q/k/v and gate/up are column-parallel (output features split,
whole heads per device), o and down are row-parallel (input features split; XLA adds the all-reduce), the embedding
and LM head are vocab-parallel, the KV cache is split by KV head. Where TP exceeds the KV heads, each KV head is
repeated (at load time) until there is one per device, as vLLM does: the cache stays split, never gathered. With expert parallelism the MoE experts are spread
over the same devices whole (the expert axis is split) instead of each expert being split by TP.

Stacked leaves carry leading stack axes (layers, and experts for MoE weights); the rules name the trailing tensor
axes, so one rule serves every stacking.
"""

from __future__ import annotations

import dataclasses
import logging
import re

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jengine.errors import ConfigError
from jengine.models.spec import ModelSpec
from jengine.parallel.mesh import TP_AXIS

logger = logging.getLogger(__name__)

T = TP_AXIS
# leaf name → spec of the per-layer tensor (no stacking axes). Conditional leaves are resolved in `_rule`.
_RULES: dict[str, tuple] = {
    "wqkv": (None, T), "bqkv": (T,),  # columns grouped per shard (models/weights.py)
    "wo": (T, None),
    "w_gate_up": (None, T), "b_gate_up": (T,), "w_down": (T, None),
    "ws_gate_up": (None, T), "ws_down": (T, None),  # Qwen2-MoE's shared expert, split as the dense MLP
    "embed": ("vocab", None), "lm_head": ("vocab", None),
    # MoE: [experts, in, out]; "ep" splits the expert axis, "tp" the expert's hidden features
    "we_gate": ("ep", None, "tp_ff"), "we_up": ("ep", None, "tp_ff"), "we_down": ("ep", "tp_ff", None),
}


# 8-bit expert stacks keep the float layout [experts, K, N] (layers/quant.py)
_EXPERT_WEIGHTS = tuple(f"['{name}'].weight" for name in ("we_gate", "we_up", "we_down"))


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How one engine's model and KV cache sit on its mesh. Hashable: it is a static argument of the jitted step."""

    mesh: Mesh
    expert_parallel: bool  # MoE experts split whole over the devices (else each expert split by TP)
    kv_head_repeat: int  # each checkpoint KV head repeated this many times (TP beyond the KV-head count), else 1
    shard_vocab: bool  # embedding and LM head split by vocabulary rows

    @property
    def size(self) -> int:
        return self.mesh.size

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def kv_cache_sharding(self) -> NamedSharding:
        """[layers, blocks, block_size, 2, kv_heads, head_dim] split on kv_heads (see docs/ARCHITECTURE.md)."""
        return NamedSharding(self.mesh, P(None, None, None, None, T, None))

    def param_spec(self, path: str, ndim: int) -> P:
        """The spec of one parameter leaf from its pytree path (`['layers'][0]['wq']`) and rank."""
        name = re.findall(r"\['([^']+)'\]", path)[-1]
        rule = _RULES.get(name)
        if rule is None or self.size == 1:
            return P()
        resolved = tuple(self._axis(a) for a in rule)
        return P(*((None,) * (ndim - len(resolved)) + resolved))

    def param_sharding(self, path: str, shape: tuple[int, ...]) -> NamedSharding:
        """The loader's callback: where each parameter goes (each device reads only its slice). The scales of an
        8-bit projection (`...['wo'].weight`, `.scale`; `layers/quant.py`) follow the float weight's rule on each
        axis they can split evenly (a block scale splits with its weight's blocks) and are replicated along the
        others (one row of per-channel scales, a static input scale)."""
        if path.endswith(".weight") and not path.endswith(_EXPERT_WEIGHTS):
            # stored [..., K / g, N, g]: K's rule on the groups, or on g when there is one group
            *lead, k_axis, n_axis = self.param_spec(path, len(shape) - 1) or (None,) * (len(shape) - 1)
            spec = P(*lead, None, n_axis, k_axis) if shape[-3] == 1 else P(*lead, k_axis, n_axis, None)
        else:
            spec = self.param_spec(path, len(shape))
        if path.endswith((".weight", ".scale", ".input_scale")):
            spec = P(*(axis if axis is None or size % self.size == 0 else None
                       for axis, size in zip(tuple(spec) + (None,) * (len(shape) - len(spec)), shape)))
        return NamedSharding(self.mesh, spec)

    def _axis(self, logical: str | None) -> str | None:
        if logical == "vocab":
            return T if self.shard_vocab else None
        if logical == "ep":
            return T if self.expert_parallel else None
        if logical == "tp_ff":
            return None if self.expert_parallel else T
        return logical


def plan_layout(spec: ModelSpec, mesh: Mesh, expert_parallel: bool = False) -> ParallelLayout:
    """Checks that the model splits over the mesh and decides the optional splits; clear errors otherwise."""
    tp = mesh.size
    _require(spec.num_heads % tp == 0, f"tensor_parallel_size={tp} does not divide the {spec.num_heads} query heads")
    _require(spec.intermediate_size % tp == 0 or spec.moe is not None and not _dense_layers(spec),
             f"tensor_parallel_size={tp} does not divide intermediate_size={spec.intermediate_size}")
    kv = spec.num_kv_heads
    _require(kv % tp == 0 or tp % kv == 0,
             f"tensor_parallel_size={tp} and the {kv} KV heads: one must divide the other")
    if spec.moe is None and expert_parallel:
        logger.warning("enable_expert_parallel has no effect: %s has no experts", spec.architecture)
    if spec.moe is not None:
        if expert_parallel:
            _require(spec.moe.num_experts % tp == 0,
                     f"expert parallelism over {tp} devices does not divide the {spec.moe.num_experts} experts")
        else:
            _require(spec.moe.intermediate_size % tp == 0, f"tensor_parallel_size={tp} does not divide the experts' "
                     f"intermediate size {spec.moe.intermediate_size} (enable_expert_parallel splits experts whole)")
        shared = spec.moe.shared_intermediate_size  # split as the dense MLP is, with or without expert parallelism
        _require(shared % tp == 0, f"tensor_parallel_size={tp} does not divide the shared expert's intermediate "
                 f"size {shared}")
    repeat = 1 if kv % tp == 0 else tp // kv
    if repeat > 1:
        logger.info("tensor_parallel_size=%d exceeds the %d KV heads: each KV head is held by %d devices", tp, kv,
                    repeat)
    return ParallelLayout(mesh, expert_parallel=expert_parallel and spec.moe is not None, kv_head_repeat=repeat,
                          shard_vocab=spec.vocab_size % tp == 0)


def _dense_layers(spec: ModelSpec) -> bool:
    return "dense" in spec.mlp_kinds


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)

