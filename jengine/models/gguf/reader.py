"""A `.gguf` file read as an HF checkpoint: `CheckpointReader`'s interface (HF tensor names, `[out, in]` shapes, a
config dict) over the file's memory-mapped tensors, each dequantized when the loader reads it.

Q8_0 projections stay in 8 bits: read as int8 `weight` + float32 `weight_scale` (one per 32 inputs) under a
compressed-tensors int8 W8A16 `quantization_config`, which the loader's 8-bit path runs. Q4_0 and Q4_K projections
are offered packed, as a 4-bit checkpoint's reader offers them (`quant`, `is_packed`, `group_rows`, `unpacked`):
4-bit values with a scale and a zero point per 32 inputs, which the loader keeps in 4 bits where the W4A16 or
grouped-matmul kernels take them (`models/quant4_place.py`) and reads dequantized elsewhere. Every other
block-quantized tensor (Q5_K, Q6_K, Q8_0 embeddings/heads or projections fused with other types, and the types
only the `gguf` package decodes: Q4_1, Q5_0, Q2_K, IQ4_XS, ...) comes out as float32 and is cast once by the loader
to the model's dtype. Tensors of a type nothing here decodes are refused by their type's name before any weight is
read.
"""

from __future__ import annotations

import collections
import json
import logging
import re
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import numpy as np

from jengine.errors import CheckpointError, UnsupportedModelError
from jengine.models.checkpoint import TensorInfo
from jengine.models.gguf.config import hf_config, llama3_rope
from jengine.models.gguf.dequant import (
    BLOCKS, INT4_GROUP, INT4_TYPES, STORED, decoded_by_gguf, dequantize, int4_parts, int4_representable, q8_0_parts)
from jengine.models.gguf.names import IGNORED, Origin, hf_names, int8_modules, unpermute_heads
from jengine.models.gguf.parts import check_tensor_count, other_parts
from jengine.models.quant4 import Unpacked
from jengine.models.quant4_load import Quant4Config

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
_PERMUTED_ARCHITECTURES = ("llama",)
_STORED_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2")}
_PROJECTION_NAME = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def is_gguf(path: str | Path) -> bool:
    """A single GGUF file (by its name and magic bytes) rather than an HF model directory."""
    path = Path(path)
    if not (path.is_file() and path.suffix == GGUF_SUFFIX):
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


# hyper-parameters llama.cpp also reads as one value per layer (`get_key_or_arr`)
_PER_LAYER_KEYS = (".attention.head_count", ".attention.head_count_kv", ".feed_forward_length")


def _scalar_metadata(reader) -> dict[str, Any]:
    """Every non-array metadata value (arrays are the vocabulary, read only by the tokenizer converter), and the
    per-layer hyper-parameters given as arrays when every layer has the same (else refused by name)."""
    from gguf import GGUFValueType

    metadata = {}
    for name, field in reader.fields.items():
        if not field.types:
            continue
        if field.types[0] != GGUFValueType.ARRAY:
            metadata[name] = field.contents()
        elif name.endswith(_PER_LAYER_KEYS):
            values = set(field.contents())
            if len(values) != 1:
                raise UnsupportedModelError(f"GGUF metadata {name} differs between layers ({sorted(values)}); "
                                            "jengine runs layers of one shape")
            metadata[name] = values.pop()
    return metadata


def _q8_0_config(modules: list[str]) -> dict[str, Any]:
    """compressed-tensors' spelling of Q8_0: symmetric int8 weights, one scale per 32 inputs, float activations."""
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"q8_0": {"targets": modules, "weights": weights, "input_activations": None}},
            "ignore": []}


def _open(path: Path, reader_class):
    try:
        return reader_class(path)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from e


def _hf_shape(name: str, gguf_dims: list[int]) -> tuple[int, ...]:
    """GGUF lists dimensions innermost first; a shared expert's gate vector is HF's one-row matrix."""
    shape = tuple(int(d) for d in reversed(gguf_dims))
    return (1, *shape) if name.endswith("ffn_gate_inp_shexp.weight") and len(shape) == 1 else shape


class GGUFCheckpoint:
    """Read-only view of one GGUF file (or the parts of a split one, `parts.py`) with HF tensor names; `read`
    dequantizes (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from gguf import GGUFReader  # the optional `gguf` extra; imported only for GGUF files
        except ImportError as e:
            raise CheckpointError(f"{path} is a GGUF file, which needs the gguf package: pip install "
                                  "'jengine[gguf]'") from e
        self._path = Path(path)
        self._file = _open(self._path, GGUFReader)
        metadata = _scalar_metadata(self._file)
        self._parts = [self._file] + [_open(part, GGUFReader) for part in other_parts(self._path, metadata)]
        tensors = {}
        for part in self._parts:
            tensors.update({t.name: t for t in part.tensors})
        if len(self._parts) > 1:
            check_tensor_count(self._path, metadata, len(tensors))
            logger.info("%s: the first of %d parts; their %d tensors read as one file", self._path.name,
                        len(self._parts), len(tensors))
        shapes = {name: _hf_shape(name, t.shape.tolist()) for name, t in tensors.items()}
        self._config = hf_config(metadata, shapes)
        if "rope_freqs.weight" in tensors:
            divisors = np.asarray(tensors["rope_freqs.weight"].data, np.float64).reshape(-1)
            self._config.update(llama3_rope(divisors, self._config["head_dim"], self._config["rope_theta"]))
        arch = metadata["general.architecture"]
        heads = ((self._config["num_attention_heads"], self._config["num_key_value_heads"])
                 if arch in _PERMUTED_ARCHITECTURES else None)
        moe_style = "mixtral" if self._config["model_type"] == "mixtral" else "qwen"
        self._origins: dict[str, Origin] = {}
        for name, tensor in tensors.items():
            found = hf_names(name, shapes[name], moe_style, heads)
            if not found and name not in IGNORED:
                logger.warning("%s: tensor %s has no HF counterpart; ignored", self._path.name, name)
            self._origins.update(found)
        self._tensors, self._shapes = tensors, shapes
        # Q8_0 projections stay in 8 bits: presented as compressed-tensors int8 W8A16 with group-32 scales (Q8_0's
        # own blocks), which the loader's 8-bit path runs
        self._int8 = int8_modules({name: self._type_name(o.tensor) for name, o in self._origins.items()})
        self._int4 = self._int4_modules()
        self._scales = {module + ".weight_scale": module + ".weight" for module in self._int8}
        if self._int8:
            self._config["quantization_config"] = _q8_0_config(sorted(self._int8))
        self._check_types()

    def _type_name(self, gguf_name: str) -> str:
        tensor = self._tensors[gguf_name]
        block = BLOCKS.get(int(tensor.tensor_type))
        if block is not None:
            return block[0]
        if decoded_by_gguf(tensor.tensor_type):
            return tensor.tensor_type.name
        raise UnsupportedModelError(
            f"{self._path.name}: tensor {gguf_name} is {tensor.tensor_type.name}, which neither jengine nor the "
            f"gguf package decodes (jengine's own: {', '.join(b[0] for b in BLOCKS.values())})")

    def _check_types(self) -> None:
        counts = collections.Counter(self._type_name(origin.tensor) for origin in self._origins.values())
        quantized = {name: n for name, n in counts.items() if name not in STORED}
        if self._int8:
            logger.info("%s: %d Q8_0 projections kept in 8 bits (int8 weights, one scale per 32 inputs)",
                        self._path.name, len(self._int8))
            quantized["Q8_0"] -= len(self._int8)
        if self._int4:
            logger.info("%s: %d Q4_0/Q4_K projections offered in 4 bits (the loader says which stay packed)",
                        self._path.name, len(self._int4))
            for module in self._int4:  # the rest of them are dequantized
                quantized[self._type_name(self._origins[module + ".weight"].tensor)] -= 1
        quantized = {name: n for name, n in quantized.items() if n}
        if quantized:
            logger.info("%s: %s tensors are dequantized at load to the model dtype", self._path.name,
                        ", ".join(f"{n} {name}" for name, n in sorted(quantized.items())))

    @property
    def quant(self) -> Quant4Config:
        """How the 4-bit projections are offered: groups of 32 inputs, as Q4_0's and Q4_K's blocks are."""
        return Quant4Config("gguf", 4, INT4_GROUP)

    def _int4_modules(self) -> frozenset[str]:
        """The modules (`model.layers.0.self_attn.q_proj`) of Q4_0/Q4_K projections every 32-input group of which is
        `(q − z)·s` (checked once per GGUF tensor: an expert stack's experts share one)."""
        representable: dict[str, bool] = {}
        modules = set()
        for name, origin in self._origins.items():
            type_name = self._type_name(origin.tensor)
            if type_name not in INT4_TYPES or not _PROJECTION_NAME.search(name):
                continue
            if origin.tensor not in representable:
                representable[origin.tensor] = int4_representable(self._tensors[origin.tensor].data, type_name)
            if representable[origin.tensor]:
                modules.add(name.removesuffix(".weight"))
        return frozenset(modules)

    def is_packed(self, module: str) -> bool:
        """Whether `module` is a Q4_0/Q4_K projection offered in 4 bits."""
        return module in self._int4

    def group_rows(self, module: str) -> tuple[np.ndarray, int]:
        """(each input row's group, the number of groups): consecutive groups of 32."""
        k = self.shape(module + ".weight")[-1]
        return np.arange(k, dtype=np.int32) // INT4_GROUP, k // INT4_GROUP

    def unpacked(self, module: str) -> Unpacked:
        """A Q4_0/Q4_K projection's values, zero points and scales in our `[in, out]` orientation (HF's row order)."""
        name = module + ".weight"
        origin = self._origin(name)
        raw = self._tensors[origin.tensor].data
        if origin.expert is not None:
            raw = raw[origin.expert]
        parts = int4_parts(raw, self._type_name(origin.tensor), self.shape(name))
        if origin.permuted_heads:
            parts = tuple(unpermute_heads(part, origin.permuted_heads) for part in parts)
        values, zeros, scales = (part.T for part in parts)
        return Unpacked(values, zeros, scales, self.group_rows(module)[0])

    @property
    def has_int4(self) -> bool:
        """Whether any projection is offered in 4 bits."""
        return bool(self._int4)

    @property
    def model_dir(self) -> Path:
        """The file (named so for the loader's messages)."""
        return self._path

    def names(self) -> list[str]:
        return sorted([*self._origins, *self._scales])

    def __contains__(self, name: object) -> bool:
        return name in self._origins or name in self._scales

    def __len__(self) -> int:
        return len(self._origins) + len(self._scales)

    def _origin(self, name: str) -> Origin:
        name = self._scales.get(name, name)
        if name not in self._origins:
            raise CheckpointError(f"tensor {name!r} not found in GGUF file {self._path}")
        return self._origins[name]

    def shape(self, name: str) -> tuple[int, ...]:
        origin = self._origin(name)
        shape = self._shapes[origin.tensor]
        shape = shape[1:] if origin.expert is not None else shape
        return (*shape[:-1], shape[-1] // 32) if name in self._scales else shape

    def dtype(self, name: str) -> np.dtype:
        """float32 for block-quantized tensors (what `read` returns), else the stored float dtype; int8 for Q8_0
        projections kept in 8 bits (their `weight_scale` float32)."""
        if name.removesuffix(".weight") in self._int8:
            return np.dtype(np.int8)
        type_name = self._type_name(self._origin(name).tensor)
        if type_name == "BF16":
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return _STORED_DTYPES.get(type_name, np.dtype("<f4"))

    def info(self, name: str) -> TensorInfo:
        shape = self.shape(name)
        return TensorInfo(file=self._path, dtype=self.dtype(name), shape=shape, start=0,
                          end=int(np.prod(shape)) * self.dtype(name).itemsize)

    def read(self, name: str) -> np.ndarray:
        """The HF tensor, dequantized (and with llama's q/k rows back in HF's order)."""
        origin = self._origin(name)
        raw = self._tensors[origin.tensor].data
        if origin.expert is not None:
            raw = raw[origin.expert]
        if name in self._scales or name.removesuffix(".weight") in self._int8:
            values, scales = q8_0_parts(raw, self.shape(self._scales.get(name, name)))
            tensor = scales if name in self._scales else values
        else:
            tensor = dequantize(raw, self._type_name(origin.tensor), self.shape(name))
        return unpermute_heads(tensor, origin.permuted_heads) if origin.permuted_heads else tensor

    def config(self) -> dict[str, Any]:
        """The HF config the metadata implies (a fresh copy each call)."""
        return json.loads(json.dumps(self._config))

    def close(self) -> None:
        """Views already handed out keep the file mapped until they are freed."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
