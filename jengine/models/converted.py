"""Save and restore already-converted parameter pytrees with orbax, so a restart skips the HF → jengine conversion.

Layout of a converted directory:
    <path>/params/                orbax StandardCheckpointer checkpoint of the pytree (tensorstore, sharding-aware)
    <path>/jengine_metadata.json  {"format": 1, "metadata": {...caller's dict: source fingerprint, dtype, ...}}
The metadata file is written last and removed first, so it doubles as a commit marker: a save that died half-way
leaves no metadata, and `converted_metadata` reports no usable conversion. Restoring reads each array straight onto
the sharding of its target, so no host ever holds the whole model.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jengine.errors import CheckpointError

logger = logging.getLogger(__name__)

PARAMS_DIR = "params"
METADATA_FILE = "jengine_metadata.json"
# Bump when the on-disk layout changes; older conversions then read as absent and are redone.
FORMAT_VERSION = 1
_MAX_LISTED = 5


def _checkpointer():
    """orbax's StandardCheckpointer, imported here: orbax takes about half a second to import, and only engines that
    save or restore a conversion need it (not every start-up)."""
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def _params_dir(path: str | Path) -> Path:
    """Absolute path of the orbax checkpoint inside a converted directory (orbax wants absolute paths)."""
    return Path(path).absolute() / PARAMS_DIR


def _write_metadata(path: Path, metadata: dict[str, Any]) -> None:
    """Writes the metadata atomically (temp file + rename), so a reader never sees half a file."""
    try:
        text = json.dumps({"format": FORMAT_VERSION, "metadata": metadata}, indent=2, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"converted-checkpoint metadata must be JSON-serialisable: {e}") from e
    tmp = path / f".{METADATA_FILE}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path / METADATA_FILE)


def save_converted(path: str | Path, params: Any, metadata: dict[str, Any]) -> None:
    """Saves a converted pytree and its metadata, replacing any earlier conversion at `path`; blocks until durable."""
    root = Path(path).absolute()
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / METADATA_FILE).unlink(missing_ok=True)
        with _checkpointer() as checkpointer:
            checkpointer.save(root / PARAMS_DIR, params, force=True)
            checkpointer.wait_until_finished()
        _write_metadata(root, metadata)
    except CheckpointError:
        raise
    except Exception as e:  # orbax/tensorstore raise many types; callers need one
        raise CheckpointError(f"cannot save converted checkpoint to {root}: {e}") from e
    logger.info("saved converted parameters to %s", root)


def converted_metadata(path: str | Path) -> dict[str, Any] | None:
    """The metadata of a complete conversion at `path`, or None when there is none (absent, partial or old format)."""
    meta_path = Path(path) / METADATA_FILE
    if not meta_path.is_file() or not _params_dir(path).is_dir():
        return None
    try:
        record = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: cannot parse converted-checkpoint metadata ({e})") from e
    if not isinstance(record, dict) or record.get("format") != FORMAT_VERSION:
        logger.info("ignoring converted checkpoint %s: format %r, expected %d", path, record, FORMAT_VERSION)
        return None
    metadata = record.get("metadata")
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{meta_path}: 'metadata' must be a JSON object")
    return metadata


def _leaf_specs(tree: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Flattens a pytree of arrays/ShapeDtypeStructs/orbax ArrayMetadata to path → (shape, dtype).

    Paths are compared as strings because orbax stores tuples as lists; `[0]` reads the same for both.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): (tuple(leaf.shape), np.dtype(leaf.dtype)) for p, leaf in leaves}


def _check_matches(params_dir: Path, stored: Any, target: Any) -> None:
    """Refuses a stored tree whose leaves differ from the target, since orbax would silently cast dtypes."""
    have, want = _leaf_specs(stored), _leaf_specs(target)
    problems = [f"{k}: missing from checkpoint" for k in want.keys() - have.keys()]
    problems += [f"{k}: in checkpoint but not in target" for k in have.keys() - want.keys()]
    common = want.keys() & have.keys()
    problems += [f"{k}: stored {have[k]} but target wants {want[k]}" for k in common if have[k] != want[k]]
    if problems:
        listed = "; ".join(sorted(problems)[:_MAX_LISTED])
        raise CheckpointError(f"converted checkpoint {params_dir} does not match the model ({len(problems)}): {listed}")


def restore_converted(path: str | Path, target: Any) -> Any:
    """Restores the pytree saved at `path`, each array placed on its target's sharding.

    `target` is the pytree of `jax.ShapeDtypeStruct`s (with `.sharding`) that the model expects; a checkpoint whose
    structure, shapes or dtypes differ raises CheckpointError rather than being cast or padded.
    """
    params_dir = _params_dir(path)
    if not params_dir.is_dir():
        raise CheckpointError(f"no converted checkpoint at {Path(path)} (missing {PARAMS_DIR}/)")
    try:
        with _checkpointer() as checkpointer:
            stored = checkpointer.metadata(params_dir).item_metadata.tree
            _check_matches(params_dir, stored, target)
            params = checkpointer.restore(params_dir, target)
    except CheckpointError:
        raise
    except Exception as e:  # orbax/tensorstore raise many types; callers need one
        raise CheckpointError(f"cannot restore converted checkpoint {params_dir}: {e}") from e
    logger.info("restored converted parameters from %s", params_dir)
    return params
