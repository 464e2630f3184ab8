"""The runner's LoRA slots: per layer, stacked A and B arrays with one entry per slot, padded to `max_lora_rank`.

A fused projection is one shrink and one expand: `qkv_a [d, slots, 3R]` holds the q, k and v A matrices side by
side (the slot axis second, so every slot's A is one `[d, slots·3R]` matrix for the shrink), `qkv_b [slots, 3R,
q+k+v]` their B matrices block-diagonally (`gate_up_*` likewise), so a layer runs four
shrinks and four expands whatever the adapters target. A module an adapter does not target, and the ranks past an
adapter's own, are zeros, so they add nothing. Loading writes one slot with one
jitted update whose shapes never change (the slot index is traced): loading never compiles a new program, and the
step's programs see arrays of the same shapes whatever the slots hold.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jengine.lora.peft import LoraAdapter, module_shapes
from jengine.models.spec import ModelSpec

# shrink group → the projections that share it, in the order their A matrices sit side by side
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
WEIGHTS = {"qkv": "wqkv", "o": "wo", "gate_up": "w_gate_up", "down": "w_down"}  # the group's model weight
ATTENTION_GROUPS = ("qkv", "o")


def layer_groups(spec: ModelSpec, layer: int) -> tuple[str, ...]:
    """The shrink groups a layer's slots hold (MoE layers: attention only)."""
    return ATTENTION_GROUPS if spec.mlp_kinds[layer] == "moe" else tuple(GROUPS)


def slot_image(spec: ModelSpec, adapter: LoraAdapter | None, max_rank: int, dtype) -> list[dict[str, np.ndarray]]:
    """One slot's arrays on the host, per layer (zeros where the adapter has nothing; None: an empty slot).

    A group's B is block-diagonal: part i's rows `[i·R, i·R + r)` feed only part i's columns, so one expand gives
    the whole fused projection's addition, in its column order."""
    shapes = module_shapes(spec)
    image = []
    for layer in range(spec.num_layers):
        pairs = adapter.layers[layer] if adapter is not None else {}
        arrays = {}
        for group in layer_groups(spec, layer):
            parts = GROUPS[group]
            widths = [shapes[p][1] for p in parts]
            a = np.zeros((shapes[parts[0]][0], len(parts) * max_rank), np.float32)
            b = np.zeros((len(parts) * max_rank, sum(widths)), np.float32)
            for i, part in enumerate(parts):
                if part in pairs:
                    a_part, b_part = pairs[part]
                    rows, column = i * max_rank, sum(widths[:i])
                    a[:, rows:rows + a_part.shape[1]] = a_part
                    b[rows:rows + b_part.shape[0], column:column + widths[i]] = b_part
            arrays[f"{group}_a"], arrays[f"{group}_b"] = a.astype(dtype), b.astype(dtype)
        image.append(arrays)
    return image


# The stacked arrays and the weights that carry A columns are donated: a load costs no second copy. Steps dispatched
# before read them first (the runtime orders the write after their reads).
@functools.partial(jax.jit, donate_argnums=(0, 1))
def _write_slot(slots: list[dict[str, jax.Array]], carriers: list[dict[str, jax.Array]],
                image: list[dict[str, jax.Array]], slot: jax.Array
                ) -> tuple[list[dict[str, jax.Array]], list[dict[str, jax.Array]]]:
    slots = [{name: stacked.at[(slice(None), slot) if name.endswith("_a") else slot].set(one[name])
              for name, stacked in layer.items()} for layer, one in zip(slots, image, strict=True)]
    carriers = [{group: _write_columns(w, one[f"{group}_a"], one[f"{group}_b"].shape[-1], slot)
                 for group, w in layer.items()} for layer, one in zip(carriers, image, strict=True)]
    return slots, carriers


def _write_columns(w: jax.Array, a: jax.Array, width: int, slot: jax.Array) -> jax.Array:
    """Slot `slot`'s A `[in, parts·R]` into the columns after the weight's own `width`."""
    return jax.lax.dynamic_update_slice(w, a.astype(w.dtype), (0, width + slot * a.shape[1]))


def _stack_empty(image: list[dict[str, np.ndarray]], num_slots: int) -> list[dict[str, np.ndarray]]:
    """Zeroed slot arrays: the slot axis second for A (`[in, slots, parts·R]`), first for B."""
    return [{name: np.zeros((a.shape[0], num_slots, a.shape[1]) if name.endswith("_a") else (num_slots,) + a.shape,
                            a.dtype) for name, a in layer.items()} for layer in image]


class DeviceLoraSlots:
    """`arrays[layer][name]`: `<group>_a [in, slots, parts·R]` and `<group>_b [slots, parts·R, out]` in the model
    dtype. One device (the fused columns are in the unsharded order). After `carry_in`, a group whose model weight
    is a plain array has no `<group>_a`: its weight holds every slot's A in `slots · parts·R` extra columns."""

    def __init__(self, spec: ModelSpec, num_slots: int, max_rank: int, dtype, sharding=None) -> None:
        if spec.projection_shards != 1:
            raise ValueError("LoRA slots are built for one device (tensor_parallel_size 1)")
        self.spec, self.num_slots, self.max_rank, self.dtype = spec, num_slots, max_rank, jnp.dtype(dtype)
        empty = slot_image(spec, None, max_rank, self.dtype)
        self.arrays = jax.device_put(_stack_empty(empty, num_slots), sharding)
        self.carried: list[tuple[str, ...]] = [() for _ in range(spec.num_layers)]  # groups whose weight holds A
        self.loaded: list[str | None] = [None] * num_slots

    def carry_in(self, params: dict) -> dict:
        """Widens each plain projection weight of `params` by its slots' A columns (zeros), in place, one weight at
        a time (the old one freed as the next is made): the shrink then rides in the projection's matmul.
        Quantized weights keep their A here. Returns `params`."""
        for index, (layer, arrays) in enumerate(zip(params["layers"], self.arrays, strict=True)):
            carried = []
            for group in layer_groups(self.spec, index):
                w = layer[WEIGHTS[group]]
                if isinstance(w, jax.Array) and w.dtype == self.dtype:
                    a = arrays.pop(f"{group}_a")
                    layer[WEIGHTS[group]] = jnp.concatenate([w, a.reshape(a.shape[0], -1)], axis=1)
                    del w
                    carried.append(group)
            self.carried[index] = tuple(carried)
        return params

    def load(self, slot: int, adapter: LoraAdapter, params: dict) -> dict:
        """Writes `adapter` into `slot`, in place (steps dispatched before read their inputs first); returns the
        model weights, whose carried A columns the write updates."""
        image = slot_image(self.spec, adapter, self.max_rank, self.dtype)
        carriers = [{group: layer[WEIGHTS[group]] for group in carried}
                    for layer, carried in zip(params["layers"], self.carried, strict=True)]
        self.arrays, carriers = _write_slot(self.arrays, carriers, image, np.int32(slot))
        self.loaded[slot] = adapter.name
        layers = [{**layer, **{WEIGHTS[g]: w for g, w in written.items()}}
                  for layer, written in zip(params["layers"], carriers, strict=True)]
        return {**params, "layers": type(params["layers"])(layers)}
