"""Split GGUF files (llama.cpp's `llama-gguf-split`, its converter's `--split-max-size`): `<name>-00001-of-0000N.gguf`
and its siblings beside it, read as one file. The first part holds the metadata (every part carries `split.no`,
`split.count` and `split.tensors.count`); each part holds some of the tensors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from jengine.errors import CheckpointError, UnsupportedModelError

_PART = re.compile(r"^(?P<stem>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$")


def other_parts(path: Path, metadata: dict[str, Any]) -> list[Path]:
    """The parts after `path` of a split file (none for a whole one); `path` must be the first part."""
    count = int(metadata.get("split.count", 1) or 1)
    if count <= 1:
        return []
    number = int(metadata.get("split.no", 0) or 0) + 1
    if number != 1:
        raise UnsupportedModelError(f"{path.name} is part {number} of a GGUF file split in {count}; give its first "
                                    "part (…-00001-of-…), which holds the metadata")
    match = _PART.match(path.name)
    if match is None or int(match["count"]) != count:
        raise CheckpointError(f"{path.name} says it is the first of {count} parts, but its name does not number "
                              f"them as llama.cpp does (<name>-00001-of-{count:05d}.gguf)")
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(2, count + 1)]
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        raise CheckpointError(f"{path.name} is the first of {count} parts; missing beside it: {', '.join(missing)}")
    return parts


def check_tensor_count(path: Path, metadata: dict[str, Any], found: int) -> None:
    expected = metadata.get("split.tensors.count")
    if expected is not None and int(expected) != found:
        raise CheckpointError(f"{path.name}: the parts hold {found} tensors; the split says {int(expected)}")
