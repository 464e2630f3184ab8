"""The runner's LoRA slots: per layer, stacked A and B arrays with one entry per slot, padded to `max_lora_rank`.

The parts of a fused projection share one shrink: `qkv_a [slots, d, 3R]` holds the q, k and v A matrices side by
side (`gate_up_a` likewise), and each part has its own expand `q_b [slots, R, q_out]`. A module an adapter does not
target, and the ranks past an adapter's own, are zeros, so they add nothing. Loading writes one slot with one
jitted update whose shapes never change (the slot index is traced): loading never compiles a new program, and the
step's programs see arrays of the same shapes whatever the slots hold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jengine.lora.peft import LoraAdapter, module_shapes
from jengine.models.spec import ModelSpec

# shrink group → the projections that share it, in the order their A matrices sit side by side
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
ATTENTION_GROUPS = ("qkv", "o")


def layer_groups(spec: ModelSpec, layer: int) -> tuple[str, ...]:
    """The shrink groups a layer's slots hold (MoE layers: attention only)."""
    return ATTENTION_GROUPS if spec.mlp_kinds[layer] == "moe" else tuple(GROUPS)


def slot_image(spec: ModelSpec, adapter: LoraAdapter | None, max_rank: int, dtype) -> list[dict[str, np.ndarray]]:
    """One slot's arrays on the host, per layer (zeros where the adapter has nothing; None: an empty slot)."""
    shapes = module_shapes(spec)
    image = []
    for layer in range(spec.num_layers):
        pairs = adapter.layers[layer] if adapter is not None else {}
        arrays = {}
        for group in layer_groups(spec, layer):
            parts = GROUPS[group]
            a = np.zeros((shapes[parts[0]][0], len(parts) * max_rank), np.float32)
            for i, part in enumerate(parts):
                b = np.zeros((max_rank, shapes[part][1]), np.float32)
                if part in pairs:
                    a_part, b_part = pairs[part]
                    a[:, i * max_rank:i * max_rank + a_part.shape[1]] = a_part
                    b[:b_part.shape[0]] = b_part
                arrays[f"{part}_b"] = b.astype(dtype)
            arrays[f"{group}_a"] = a.astype(dtype)
        image.append(arrays)
    return image


@jax.jit
def _write_slot(slots: list[dict[str, jax.Array]], image: list[dict[str, jax.Array]], slot: jax.Array
                ) -> list[dict[str, jax.Array]]:
    return jax.tree_util.tree_map(lambda stacked, one: stacked.at[slot].set(one), slots, image)


class DeviceLoraSlots:
    """`arrays[layer][name]`: `<group>_a [slots, in, parts·R]` and `<part>_b [slots, R, out]` in the model dtype."""

    def __init__(self, spec: ModelSpec, num_slots: int, max_rank: int, dtype, sharding=None) -> None:
        self.spec, self.num_slots, self.max_rank, self.dtype = spec, num_slots, max_rank, jnp.dtype(dtype)
        empty = slot_image(spec, None, max_rank, self.dtype)
        stacked = jax.tree_util.tree_map(lambda a: np.zeros((num_slots,) + a.shape, a.dtype), empty)
        self.arrays = jax.device_put(stacked, sharding)
        self.loaded: list[str | None] = [None] * num_slots

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Writes `adapter` into `slot` (steps dispatched before keep reading the arrays they were given)."""
        image = slot_image(self.spec, adapter, self.max_rank, self.dtype)
        self.arrays = _write_slot(self.arrays, image, np.int32(slot))
        self.loaded[slot] = adapter.name
