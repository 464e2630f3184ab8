"""Host-side reader of Hugging Face checkpoint directories (config.json + safetensors).

The safetensors format is parsed here rather than through the `safetensors` package so that every file is validated
with errors that name the file and the tensor, and so that each file is memory-mapped exactly once: a tensor read is a
zero-copy, read-only numpy view of the page cache, and the loader touches only the bytes of the slices it places on
each device. This module does not import jax (numpy and ml_dtypes only), so it can run where no accelerator is set up.
Pickle-based weights (`*.bin`, `*.pt`, `*.pth`) are never loaded: unpickling runs code from the file.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, Self

import ml_dtypes
import numpy as np

from jengine.errors import CheckpointError
from jengine.models.fused_experts import has_fused_experts, per_expert_names

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# Same limit as the reference implementation: a larger header is a corrupt or hostile file, not a model.
_MAX_HEADER_BYTES = 100_000_000
_HEADER_LEN_BYTES = 8

# safetensors dtype code -> numpy dtype. The format is little-endian, so numpy dtypes carry an explicit byte order.
_DTYPES: Mapping[str, np.dtype] = MappingProxyType(
    {
        "F64": np.dtype("<f8"),
        "F32": np.dtype("<f4"),
        "F16": np.dtype("<f2"),
        "BF16": np.dtype(ml_dtypes.bfloat16),
        "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
        "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
        "I64": np.dtype("<i8"),
        "I32": np.dtype("<i4"),
        "I16": np.dtype("<i2"),
        "I8": np.dtype("i1"),
        "U8": np.dtype("u1"),
        "BOOL": np.dtype(np.bool_),
    }
)
# ml_dtypes' bfloat16 and float8_e4m3fn report kind "V", so "floating" is spelled out rather than asked of numpy.
_FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
_FLOAT_DTYPES = frozenset(_DTYPES[code] for code in _FLOAT_CODES)

_CONVERT_HINT = (
    "only safetensors weights are loaded (pickle files can run code and are never opened); convert the checkpoint "
    "once, in an environment you trust, e.g. `AutoModelForCausalLM.from_pretrained(src).save_pretrained(dst, "
    "safe_serialization=True)` with transformers, then point jengine at the new directory"
)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype, shape and absolute byte range inside the file."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.end - self.start


def _fail(path: Path, message: str) -> CheckpointError:
    """Builds an error that always names the offending file, so a bad shard in a 60-file model is easy to find."""
    return CheckpointError(f"{path}: {message}")


def _read_header(path: Path, file_size: int) -> tuple[dict[str, Any], int]:
    """Reads and decodes the JSON header; returns it and the absolute offset where tensor data begins."""
    if file_size < _HEADER_LEN_BYTES:
        raise _fail(path, f"file is {file_size} bytes, too small to be safetensors (truncated?)")
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(_HEADER_LEN_BYTES), "little")
        if header_len > _MAX_HEADER_BYTES:
            raise _fail(path, f"header length {header_len} exceeds the {_MAX_HEADER_BYTES}-byte limit (corrupt file?)")
        if header_len > file_size - _HEADER_LEN_BYTES:
            raise _fail(path, f"header length {header_len} runs past the end of the {file_size}-byte file")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"header is not valid UTF-8 JSON ({e}); the file is corrupt or not safetensors") from e
    if not isinstance(header, dict):
        raise _fail(path, f"header is a JSON {type(header).__name__}, expected an object")
    return header, _HEADER_LEN_BYTES + header_len


def _is_int_list(value: Any, length: int | None = None) -> bool:
    """True for a JSON list of non-negative ints (bools excluded), optionally of a given length."""
    ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    return ok and (length is None or len(value) == length)


def _parse_entry(path: Path, name: str, entry: Any, data_start: int, file_size: int) -> TensorInfo:
    """Validates one header entry against the format and the file size, and locates its bytes."""
    if not isinstance(entry, dict):
        raise _fail(path, f"tensor {name!r}: header entry is not an object")
    code = entry.get("dtype")
    if not isinstance(code, str) or code not in _DTYPES:
        raise _fail(path, f"tensor {name!r} has unsupported dtype {code!r} (supported: {', '.join(_DTYPES)})")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not _is_int_list(shape):
        raise _fail(path, f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if not _is_int_list(offsets, 2) or offsets[0] > offsets[1]:
        raise _fail(path, f"tensor {name!r}: data_offsets {offsets!r} is not an ordered [begin, end] pair")
    dtype = _DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != expected:
        raise _fail(
            path,
            f"tensor {name!r}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes but shape {shape} "
            f"of {code} needs {expected}",
        )
    start, end = data_start + offsets[0], data_start + offsets[1]
    if end > file_size:
        raise _fail(path, f"tensor {name!r}: data ends at byte {end}, past the end of file ({file_size} B); truncated?")
    return TensorInfo(file=path, dtype=dtype, shape=tuple(shape), start=start, end=end)


def parse_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parses and validates one safetensors file's header; returns tensor name -> location, without reading data."""
    try:
        file_size = path.stat().st_size
    except OSError as e:
        raise _fail(path, f"cannot read weight file ({e.strerror})") from e
    header, data_start = _read_header(path, file_size)
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise _fail(path, "__metadata__ must be a JSON object of strings")
    return {name: _parse_entry(path, name, entry, data_start, file_size) for name, entry in header.items()}


def _inside(model_dir: Path, filename: str) -> Path:
    """Resolves a file named by the index, refusing names that escape the model directory."""
    path = (model_dir / filename).resolve()
    if not path.is_relative_to(model_dir.resolve()):
        raise _fail(model_dir / INDEX_FILE, f"weight_map names {filename!r}, which is outside the model directory")
    return path


def _files_from_index(model_dir: Path) -> tuple[list[Path], dict[str, Path]]:
    """Reads the shard index; returns the shard files and, for cross-checking, which file each tensor should be in."""
    index_path = model_dir / INDEX_FILE
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise _fail(index_path, f"cannot read the shard index ({e})") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise _fail(index_path, "has no 'weight_map' object mapping tensor names to file names")
    expected = {name: _inside(model_dir, filename) for name, filename in weight_map.items()}
    files = sorted(set(expected.values()))
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        raise _fail(index_path, f"names weight file(s) that do not exist in {model_dir}: {', '.join(missing)}")
    return files, expected


def _discover_files(model_dir: Path) -> tuple[list[Path], dict[str, Path]]:
    """Finds the weight files: the index's shards, else every *.safetensors; explains pickle-only directories."""
    if (model_dir / INDEX_FILE).is_file():
        return _files_from_index(model_dir)
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    if files:
        return files, {}
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{model_dir} has only pickle weights ({', '.join(pickles[:5])}): {_CONVERT_HINT}")
    raise CheckpointError(f"no weight files (*.safetensors or {INDEX_FILE}) found in {model_dir}")


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json of a model directory, read before any weight file is looked at (the architecture comes first)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory not found: {model_dir}")
    return _load_config(model_dir)


_BASE_MODEL_PREFIX = "model."
_WRAPPER_PREFIX = "base_model.model."  # a PEFT-wrapped model saved whole (adapters merged)


def _canonical_names(tensors: dict[str, TensorInfo], model_dir: Path) -> dict[str, TensorInfo]:
    """The names a causal-LM checkpoint has, as HF's loader accepts the others: a wrapper's `base_model.model.`
    prefix dropped, and the `model.` prefix added where the weights were saved from the base model alone
    (`embed_tokens.weight`, `layers.0...`)."""
    if tensors and all(name.startswith(_WRAPPER_PREFIX) for name in tensors):
        logger.info("%s: tensor names carry %r; reading them without it", model_dir, _WRAPPER_PREFIX)
        tensors = {name[len(_WRAPPER_PREFIX):]: info for name, info in tensors.items()}
    if "embed_tokens.weight" in tensors and not any(name.startswith(_BASE_MODEL_PREFIX) for name in tensors):
        logger.info("%s: the weights were saved from the base model (no %r prefix); reading them with it",
                    model_dir, _BASE_MODEL_PREFIX)
        tensors = {(name if name.startswith("lm_head.") else _BASE_MODEL_PREFIX + name): info
                   for name, info in tensors.items()}
    if has_fused_experts(tensors):
        logger.info("%s: expert stacks saved fused (transformers 5); reading each expert from them", model_dir)
        tensors = per_expert_names(tensors, lambda: _load_config(model_dir))
    return tensors


def _load_config(model_dir: Path) -> dict[str, Any]:
    """Reads config.json, which every HF model directory has and without which the architecture is unknown."""
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{CONFIG_FILE} not found in {model_dir}; is this a Hugging Face model directory?")
    config = _json_object(path)
    if not (config.get("quantization_config") or config.get("compression_config")):
        side = _side_quant_config(model_dir)
        if side is not None:
            config = {**config, "quantization_config": side}
    return config


def _json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"cannot parse ({e})") from e
    if not isinstance(value, dict):
        raise _fail(path, "must hold a JSON object")
    return value


# Where AutoGPTQ (≤ 0.4), AutoAWQ and NVIDIA's Model Optimizer wrote their settings when config.json carried none
SIDE_QUANT_CONFIGS = ("quantize_config.json", "quant_config.json", "hf_quant_config.json")
_AWQ_KEYS, _GPTQ_KEYS = {"w_bit", "q_group_size", "zero_point", "version"}, {"desc_act", "damp_percent", "sym",
                                                                           "static_groups", "true_sequential"}


def _side_quant_config(model_dir: Path) -> dict[str, Any] | None:
    """The quantization settings of a side file, its method named (`quant_method`, else told by its keys: AWQ's
    `w_bit` / `version`, GPTQ's `desc_act` / `damp_percent`; ModelOpt's by its file name), or None where there is
    no such file or it says neither."""
    path = next((model_dir / name for name in SIDE_QUANT_CONFIGS if (model_dir / name).is_file()), None)
    if path is None:
        return None
    side = _json_object(path)
    method = side.get("quant_method") or ("modelopt" if path.name == "hf_quant_config.json" else
                                          "awq" if _AWQ_KEYS & side.keys() else
                                          "gptq" if _GPTQ_KEYS & side.keys() else None)
    if method is None:  # some other tool's file: the checkpoint's tensors say what they are
        logger.warning("%s names no quant_method and holds neither AWQ's nor GPTQ's settings; not read", path)
        return None
    logger.info("%s: quantization settings (%s) read from %s; config.json has none", model_dir, method, path.name)
    return {**side, "quant_method": str(method).lower()}


def _index_tensors(files: list[Path], expected: dict[str, Path]) -> dict[str, TensorInfo]:
    """Merges the headers of all files, rejecting duplicate names and an index that disagrees with the files."""
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        for name, info in parse_safetensors_header(path).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} appears in both {tensors[name].file.name} and {path.name}")
            tensors[name] = info
    for name, path in expected.items():
        if name not in tensors or tensors[name].file != path:
            raise _fail(path, f"the shard index says tensor {name!r} is here, but the file does not hold it")
    return tensors


class CheckpointReader:
    """Read-only view of a model directory: its config and every tensor, each file memory-mapped once.

    Arrays returned by `read`/`read_slice` are read-only views into the mapping; they stay valid after `close()`
    (the OS unmaps a file when its last view is garbage-collected), but the reader itself refuses further reads.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self._dir = Path(model_dir)
        if not self._dir.is_dir():
            raise CheckpointError(f"model directory not found: {self._dir}")
        self._config = _load_config(self._dir)
        files, expected = _discover_files(self._dir)
        self._tensors = _canonical_names(_index_tensors(files, expected), self._dir)
        self._maps: dict[Path, np.ndarray] | None = {path: self._map(path) for path in files}
        logger.debug(
            "opened %s: %d tensors in %d file(s), %d bytes",
            self._dir, len(self._tensors), len(files), self.nbytes_total,
        )

    @staticmethod
    def _map(path: Path) -> np.ndarray:
        """Maps a whole file read-only; tensor reads are slices of this one mapping (plain ndarrays, not memmaps)."""
        try:
            return np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
        except (OSError, ValueError) as e:
            raise _fail(path, f"cannot memory-map ({e})") from e

    @property
    def model_dir(self) -> Path:
        """The directory this reader was opened on."""
        return self._dir

    @property
    def nbytes_total(self) -> int:
        """Bytes of tensor data over all files (what loading every weight moves)."""
        return sum(info.nbytes for info in self._tensors.values())

    def names(self) -> list[str]:
        """All tensor names, sorted, so callers iterate in a deterministic order."""
        return sorted(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._tensors)

    def info(self, name: str) -> TensorInfo:
        """The location of one tensor; a missing name raises an error that suggests close names."""
        info = self._tensors.get(name)
        if info is None:
            close = difflib.get_close_matches(name, self._tensors, n=5, cutoff=0.5)
            hint = f"; close names: {', '.join(close)}" if close else ""
            if name == "lm_head.weight":
                hint += ("; config.json does not set tie_word_embeddings to true, so the LM head must be in the "
                         "checkpoint")
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {self._dir}{hint}")
        return info

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the header (no data is read)."""
        return self.info(name).shape

    def dtype(self, name: str) -> np.dtype:
        """The tensor's numpy dtype (ml_dtypes for bfloat16 and float8), from the header."""
        return self.info(name).dtype

    def read(self, name: str) -> np.ndarray:
        """The whole tensor as a read-only zero-copy view of the file mapping (pages load when touched)."""
        info = self.info(name)
        if self._maps is None:
            raise CheckpointError(f"checkpoint reader for {self._dir} is closed")
        return self._maps[info.file][info.start : info.end].view(info.dtype).reshape(info.shape)

    def read_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """A basic-slicing view of the tensor, so a tensor-parallel shard reads only its own pages."""
        if not isinstance(index, tuple) or not all(isinstance(s, slice) for s in index):
            raise TypeError(f"read_slice index must be a tuple of slices, got {index!r}")
        shape = self.shape(name)
        if len(index) > len(shape):
            raise CheckpointError(f"tensor {name!r} has shape {shape}; cannot index it with {len(index)} slices")
        return self.read(name)[index]

    def config(self) -> dict[str, Any]:
        """config.json as parsed (a fresh copy each call, so callers cannot alter the reader's view)."""
        return json.loads(json.dumps(self._config))

    def close(self) -> None:
        """Drops the reader's mappings; views already handed out keep their file mapped until they are freed."""
        self._maps = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self._dir)!r}, tensors={len(self._tensors)})"


def checkpoint_dtype(reader: CheckpointReader) -> np.dtype:
    """The floating dtype holding the most bytes: the checkpoint's native precision, the default `dtype="auto"`."""
    totals: dict[np.dtype, int] = {}
    for name in reader.names():
        info = reader.info(name)
        if info.dtype in _FLOAT_DTYPES:
            totals[info.dtype] = totals.get(info.dtype, 0) + info.nbytes
    if not totals:
        raise CheckpointError(f"checkpoint {reader.model_dir} holds no floating-point tensors")
    return max(totals, key=lambda d: (totals[d], d.itemsize))
