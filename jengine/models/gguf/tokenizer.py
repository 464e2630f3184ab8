"""The vocabulary embedded in a GGUF file → an HF tokenizer directory (used when no `--tokenizer` is given).

transformers' GGUF converter rebuilds the tokenizer from the file's `tokenizer.ggml.*` arrays. It is slow on real
vocabularies (minutes for 150k tokens), so the result is saved once per file under the cache directory and a warning
says to pass the base model's tokenizer instead, as vLLM advises.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from jengine.errors import CheckpointError

logger = logging.getLogger(__name__)

CACHE_DIR = Path.home() / ".cache" / "jengine" / "gguf-tokenizers"
_DONE = "tokenizer.json"


def _file_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]


def embedded_tokenizer_dir(path: str | Path, cache_dir: Path = CACHE_DIR) -> Path:
    """A directory holding the file's own tokenizer, converted on first use."""
    path = Path(path)
    target = cache_dir / _file_key(path)
    if (target / _DONE).is_file():
        logger.info("%s: using its tokenizer converted earlier (%s)", path.name, target)
        return target
    logger.warning("%s: no --tokenizer given; converting the vocabulary embedded in the GGUF file to an HF tokenizer, "
                   "which is slow for large vocabularies. Pass --tokenizer (tokenizer=) with the base model's "
                   "directory to skip it", path.name)
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError, NotImplementedError) as e:
        raise CheckpointError(f"{path}: its embedded vocabulary could not be converted to an HF tokenizer ({e}); "
                              "pass --tokenizer DIR") from e
    staging = target.with_name(target.name + ".partial")
    hf.save_pretrained(staging)
    staging.replace(target)  # whole or absent: a crash mid-save is converted again next time
    return target
