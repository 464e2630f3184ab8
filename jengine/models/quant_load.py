"""Reading 8-bit projections from a checkpoint into `QuantizedWeight`s of our layout, and placing them.

A checkpoint module (`...q_proj`) holds its weight `[out, in]` in float8 or int8 (or `weight_packed`, four int8
values per little-endian int32, each stored + 128), a float scale of `[out_groups, in_groups]` (a scalar or
`[out, 1]` per tensor or channel, `[out, in / group]`, or one per `out_block × in_block`) and, with static
activations, an `input_scale`. Ours is transposed to `[in, out]` with `scale [in_groups, out_groups]`
(`layers/quant.py`). Fused projections (q/k/v, gate/up) concatenate the parts' columns per shard as the float loader
does (`models/weights.py`), their scales alongside: per-tensor scales become per-column ones, and block scales whose
blocks straddle a part or shard boundary are spread to one per column. Static activation scales of fused parts
(the same input) take their maximum, as vLLM does.
"""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np

from jengine.errors import CheckpointError, UnsupportedModelError
from jengine.layers.quant import QuantizedWeight, QuantScheme, quantize_weight_per_channel
from jengine.models.checkpoint import CheckpointReader
from jengine.models.quant_config import ModuleQuant, QuantConfig
from jengine.models.weights import FusedSource, LeafSource, Source

# The projections that run quantized; routers and the LM head stay in float (a quantized LM head is dequantized).
QUANTIZED_LEAVES = ("wqkv", "wo", "w_gate_up", "w_down", "ws_gate_up", "ws_down", "we_gate", "we_up", "we_down")
_STORED = {"fp8": np.dtype(ml_dtypes.float8_e4m3fn), "int8": np.dtype("i1")}


def quant8_impl(platform: str) -> str:
    """The 8-bit matmuls' implementation for `platform`: the dequantizing reference on the CPU, XLA's elsewhere."""
    return "reference" if platform == "cpu" else "xla"


@dataclasses.dataclass(frozen=True)
class HostQuantized:
    """One module or leaf on the host, in our layout: weight `[..., in, out]`, scale `[..., in_g, out_g]`."""

    weight: np.ndarray
    scale: np.ndarray
    input_scale: np.ndarray | None
    scheme: QuantScheme


def module_name(tensor_name: str) -> str:
    return tensor_name.removesuffix(".weight")


def leaf_quant(quant: QuantConfig, reader: CheckpointReader, leaf: Source) -> ModuleQuant | None:
    """The leaf's one storage and scheme (every part and expert alike), or None when it stays float."""
    names = [str(n) for part in (leaf.parts if isinstance(leaf, FusedSource) else (leaf,)) for n in part.names.flat]
    hows = [module_quant(quant, reader, module_name(n)) for n in names]
    if any(h != hows[0] for h in hows):
        raise CheckpointError(f"{names[0]} and the projections fused with it ({', '.join(names[1:4])}) are not "
                              "quantized alike; jengine runs them as one matmul")
    return hows[0]


def module_quant(quant: QuantConfig, reader: CheckpointReader, module: str) -> ModuleQuant | None:
    """The config's answer for one module, checked against what the checkpoint stores."""
    how = quant.module(module)
    stored = _stored_kind(reader, module)
    if quant.from_tensors:  # fp8 method: the tensors say which modules are float8
        ignored = quant.module(module) is None
        if stored != "float" and ignored:
            raise CheckpointError(f"{module} is listed as not converted but its weight is stored in 8 bits")
        return None if stored == "float" else how
    if how is None or how.storage == "float":
        if stored != "float":
            raise CheckpointError(f"{module} is stored in 8 bits but quantization_config does not target it")
        return how
    if stored != how.storage:
        raise CheckpointError(f"{module}: quantization_config says {how.storage} weights, the checkpoint stores "
                              f"{stored}")
    return how


def _stored_kind(reader: CheckpointReader, module: str) -> str:
    if module + ".weight_packed" in reader:
        return "packed8"
    dtype = reader.dtype(module + ".weight")
    return next((kind for kind, d in _STORED.items() if d == dtype), "float")


def read_module(reader: CheckpointReader, module: str, how: ModuleQuant) -> tuple[np.ndarray, np.ndarray, float | None]:
    """(weight `[out, in]` in 8 bits, float32 scale `[out_g, in_g]`, static input scale) as the checkpoint has
    them, shapes checked."""
    if module + ".weight_g_idx" in reader:
        raise UnsupportedModelError(f"{module} has a weight_g_idx (activation-ordered groups), which 8-bit "
                                    "weights are not read with")
    weight = _unpack(reader, module) if how.storage == "packed8" else reader.read(module + ".weight")
    out, inp = weight.shape
    scale = np.asarray(reader.read(module + "." + how.scale_name), np.float32)
    if scale.ndim == 4 and scale.shape[1] == scale.shape[3] == 1:  # ModelOpt's blocks: [out_b, 1, in_b, 1]
        scale = scale.reshape(scale.shape[0], scale.shape[2])
    if how.scheme.block_k == 0:
        if scale.size not in (1, out):
            raise CheckpointError(f"{module}.{how.scale_name} has shape {scale.shape}; a per-tensor or per-channel "
                                  f"scale has 1 or {out} values")
        scale = np.broadcast_to(scale.reshape(-1, 1), (out, 1))
    else:
        block_out, block_in = how.block_out_in or (1, how.scheme.block_k)
        expected = (-(-out // block_out), -(-inp // block_in))
        if scale.shape != expected:
            raise CheckpointError(f"{module}.{how.scale_name} has shape {scale.shape}; blocks of {block_out} x "
                                  f"{block_in} on a {out} x {inp} weight need {expected}")
    if not np.isfinite(scale).all():
        raise CheckpointError(f"{module}.{how.scale_name} holds non-finite values")
    input_scale = None
    if how.static_input:
        input_scale = float(np.asarray(reader.read(module + ".input_scale"), np.float32).max())
    return weight, scale, input_scale


def _unpack(reader: CheckpointReader, module: str) -> np.ndarray:
    """pack-quantized with 8 bits: int32 word j of a row holds values 4j..4j+3, value 4j in its low byte, each + 128."""
    packed = reader.read(module + ".weight_packed")
    shape = tuple(int(s) for s in np.asarray(reader.read(module + ".weight_shape")).reshape(-1))
    if packed.dtype != np.dtype("<i4") or len(shape) != 2 or packed.shape != (shape[0], -(-shape[1] // 4)):
        raise CheckpointError(f"{module}.weight_packed has shape {packed.shape} ({packed.dtype}); 8-bit packing of "
                              f"a {shape} weight needs int32 ({shape[0]}, {-(-shape[1] // 4)})")
    stored = np.ascontiguousarray(packed).view(np.uint8).reshape(shape[0], -1)[:, : shape[1]]
    return (stored.astype(np.int16) - 128).astype(np.int8)


def _part(reader: CheckpointReader, leaf: LeafSource, how: ModuleQuant) -> HostQuantized:
    """One (possibly expert-stacked) single projection in our layout, heads repeated as the float loader does."""
    pieces = [read_module(reader, module_name(str(n)), how) for n in leaf.names.flat]
    weight = np.stack([leaf.from_checkpoint(w) for w, _, _ in pieces]).reshape(leaf.shape)
    scale = np.stack([s.T for _, s, _ in pieces]).reshape(leaf.names.shape + pieces[0][1].T.shape)
    scheme = how.scheme
    if leaf.head_repeat > 1:
        scale, scheme = _per_column(scale, scheme, leaf.checkpoint_shape[0]), dataclasses.replace(scheme, block_n=1)
        heads = scale.reshape(scale.shape[:-1] + (-1, leaf.head_dim))
        scale = np.repeat(heads, leaf.head_repeat, axis=-2).reshape(scale.shape[:-1] + (-1,))
    statics = [s for _, _, s in pieces if s is not None]
    return HostQuantized(weight, scale, np.float32(max(statics)) if statics else None, scheme)


def _per_column(scale: np.ndarray, scheme: QuantScheme, out: int) -> np.ndarray:
    return np.repeat(scale, scheme.block_n, axis=-1)[..., :out] if scheme.block_n > 1 else scale


def read_leaf(reader: CheckpointReader, leaf: Source, how: ModuleQuant) -> HostQuantized:
    """A leaf in our layout from its checkpoint modules: stored 8-bit ones, or float ones quantized here."""
    if how.storage == "float":
        return _quantized_at_load(reader, leaf)
    if isinstance(leaf, LeafSource):
        return _part(reader, leaf, how)
    parts = [_part(reader, p, how) for p in leaf.parts]
    block_n = parts[0].scheme.block_n
    compact = all(p.scheme.block_n == block_n and p.weight.shape[-1] % (leaf.shards * block_n) == 0 for p in parts)
    if not compact:
        parts = [dataclasses.replace(p, scale=_per_column(p.scale, p.scheme, p.weight.shape[-1])) for p in parts]
        block_n = 1
    statics = [p.input_scale for p in parts if p.input_scale is not None]
    return HostQuantized(leaf.fuse([p.weight for p in parts]), leaf.fuse([p.scale for p in parts]),
                         np.float32(max(statics)) if statics else None,
                         dataclasses.replace(parts[0].scheme, block_n=block_n))


def _quantized_at_load(reader: CheckpointReader, leaf: Source) -> HostQuantized:
    """`--quantization fp8` on a float checkpoint: the leaf in float32, then one float8 scale per output feature."""
    parts = leaf.parts if isinstance(leaf, FusedSource) else (leaf,)
    floats = [np.stack([p.from_checkpoint(np.asarray(reader.read(str(n)), np.float32)) for n in p.names.flat])
              .reshape(p.shape) for p in parts]
    full = leaf.fuse(floats) if isinstance(leaf, FusedSource) else floats[0]
    weight, scale = quantize_weight_per_channel(full)
    return HostQuantized(weight, scale, None, QuantScheme("fp8", "fp8"))


def dequantized_float(reader: CheckpointReader, name: str, how: ModuleQuant) -> np.ndarray:
    """A stored 8-bit module as float32 `[out, in]` (for projections run in float, such as a quantized LM head)."""
    weight, scale, _ = read_module(reader, module_name(name), how)
    out, inp = weight.shape
    if how.scheme.block_k == 0:
        block_out, block_in = 1, inp
    else:
        block_out, block_in = how.block_out_in or (1, how.scheme.block_k)
    full = np.repeat(np.repeat(scale, block_out, axis=0), block_in, axis=1)[:out, :inp]
    return weight.astype(np.float32) * full


def place(host: HostQuantized, path: str, sharding_for, impl: str) -> QuantizedWeight:
    """Puts one leaf on the devices in the stored layout (`layers/quant.py`); its scales follow the weight's rule
    (`parallel/sharding.py`)."""
    def put(array: np.ndarray, name: str) -> jax.Array:
        sharding = sharding_for(path + name, array.shape)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    stored = QuantizedWeight.from_kn(host.weight, np.ascontiguousarray(host.scale, np.float32), host.input_scale,
                                     dataclasses.replace(host.scheme, impl=impl), keep_kn=host.weight.ndim > 2)
    input_scale = None if host.input_scale is None else put(np.asarray(host.input_scale, np.float32), ".input_scale")
    return dataclasses.replace(stored, weight=put(np.ascontiguousarray(stored.weight), ".weight"),
                               scale=put(stored.scale, ".scale"), input_scale=input_scale)
