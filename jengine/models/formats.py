"""Which reader a model path needs: an HF directory (`CheckpointReader`), one whose 4-bit weights are unpacked at
load (`models/quant4/`), or a single `.gguf` file (`models/gguf/`). All three present the same interface: HF tensor
names, `[out, in]` float tensors, the HF config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jengine.errors import UnsupportedModelError
from jengine.models.checkpoint import CheckpointReader, read_config
from jengine.models.gguf.reader import GGUFCheckpoint, is_gguf
from jengine.models.quant4_load import Quant4Reader, read_quant4_config


def read_model_config(model: str | Path) -> dict[str, Any]:
    """config.json, or the config a GGUF file's metadata implies."""
    if is_gguf(model):
        with GGUFCheckpoint(model) as reader:
            return reader.config()
    return read_config(model)


def unpacked_at_open(config: dict[str, Any], requested: str | None) -> bool:
    """True for 4-bit checkpoints: their reader dequantizes at load, so the 8-bit planner (`models/quant_config.py`)
    is not asked; `requested` (--quantization) must then name the checkpoint's method. (A GGUF file's config has no
    quantization_config: the planner sees a float model.)"""
    quant = read_quant4_config(config)
    if quant is None:
        return False
    if requested not in (None, quant.method):
        raise UnsupportedModelError(f"quantization={requested!r} does not match the checkpoint's quant_method "
                                    f"{quant.method!r}")
    return True


def open_checkpoint(model: str | Path) -> CheckpointReader | GGUFCheckpoint | Quant4Reader:
    """The reader for `model`; the hook where a checkpoint's `quantization_config` picks a 4-bit unpacking reader
    (8-bit methods are the loader's own)."""
    if is_gguf(model):
        return GGUFCheckpoint(model)
    reader = CheckpointReader(model)
    quant = read_quant4_config(reader.config())
    return Quant4Reader(reader, quant) if quant is not None else reader


def tokenizer_dir(model: str | Path, tokenizer: str | Path | None) -> Path:
    """The tokenizer's directory: the one given, the model's own, or a GGUF file's embedded vocabulary converted."""
    if tokenizer is not None:
        return Path(tokenizer)
    if is_gguf(model):
        from jengine.models.gguf.tokenizer import embedded_tokenizer_dir

        return embedded_tokenizer_dir(model)
    return Path(model)


def generation_config_dir(model: str | Path, tokenizer_directory: str | Path) -> Path:
    """Where `generation_config.json` is looked for: the model's directory, or for a GGUF file (which has none
    beside it) the tokenizer's, the base model's directory `--tokenizer` names."""
    return Path(tokenizer_directory) if is_gguf(model) else Path(model)
