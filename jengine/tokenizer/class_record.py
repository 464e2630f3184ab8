"""Which tokenizer class `AutoTokenizer` chose for a model directory, remembered so a restart loads that class directly.

`AutoTokenizer` decides the class from config.json, tokenizer_config.json and tokenizer.json, and reading config.json
imports transformers' configuration module, which imports PyTorch where it is installed: seconds of a start that
needs no PyTorch at all (8 s of a 26 s warm start on a GPU host). The named class alone imports none of it. So the
first load goes through `AutoTokenizer` and records its choice beside the compilation cache; a later start whose
directory and transformers version are unchanged calls that class's `from_pretrained` on the same files. The key is
the directory's path (`AutoTokenizer` matches model ids against it) and every non-weight file's name, size and
modification time, so an edited tokenizer_config.json or tokenizer.json is decided anew.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from pathlib import Path
from typing import Any

RECORD_DIR = "jengine-tokenizer-classes"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")


def directory_key(model_dir: Path, transformers_version: str) -> str:
    """A digest of what `AutoTokenizer`'s choice can depend on: the path, the library's version and the files."""
    digest = hashlib.sha256(f"{model_dir.resolve()}\0{transformers_version}".encode())
    for entry in sorted(os.scandir(model_dir), key=lambda e: e.name):
        if entry.is_file() and not entry.name.endswith(WEIGHT_SUFFIXES):
            stat = entry.stat()
            digest.update(f"\0{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def recorded_class(record_dir: Path, key: str) -> type | None:
    """The tokenizer class recorded under `key`, or None (no record, or one naming what no longer imports)."""
    import transformers

    try:
        record = json.loads((record_dir / RECORD_DIR / f"{key}.json").read_text())
        module = importlib.import_module(record["module"])
        cls = getattr(module, record["name"])
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase) else None


def record_class(record_dir: Path, key: str, tokenizer: Any) -> None:
    """Remember `tokenizer`'s class under `key` (transformers' own classes only: nothing loaded as remote code).
    Written whole under a temporary name, then renamed, so processes sharing the directory never read half a file."""
    cls = type(tokenizer)
    if not cls.__module__.startswith("transformers."):
        return
    folder = record_dir / RECORD_DIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
        temporary = folder / f"{key}.{os.getpid()}.tmp"
        temporary.write_text(json.dumps({"module": cls.__module__, "name": cls.__name__}))
        os.replace(temporary, folder / f"{key}.json")
    except OSError:  # a read-only cache only costs the next start its speed
        return
