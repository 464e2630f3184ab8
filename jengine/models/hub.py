"""A model name as vLLM takes it → a local checkpoint directory.

Three kinds of name: none (or the demo's served name) is the tiny random-weight demo model, built offline; an
existing path (a checkpoint directory or a GGUF file) is used as it is; anything else of the form `ORG/NAME` (or `NAME`) is a Hugging Face Hub model id,
read from the local hub cache (`models--ORG--NAME/snapshots/<sha>/`, found through `refs/<revision>`) and, unless
`HF_HUB_OFFLINE=1`, downloaded into it by `huggingface_hub.snapshot_download` first: only the files jengine reads
(safetensors weights, config, generation config, tokenizer and chat-template files), never pickled `*.bin`/`*.pt`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

from jengine.config import hub_settings
from jengine.errors import CheckpointError
from jengine.models.checkpoint import SIDE_QUANT_CONFIGS

logger = logging.getLogger(__name__)

# What a checkpoint directory needs here; pickled weights (*.bin, *.pt, *.pth) are never fetched (safetensors only).
HUB_FILE_PATTERNS = (
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.json", "chat_template.jinja", "*.jinja",
    *SIDE_QUANT_CONFIGS,  # older AWQ / GPTQ repositories keep their quantization settings there
)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    path: Path  # the local checkpoint directory
    name: str  # what a server calls it by default: the hub id, the demo's name, or the directory as given


def resolve_model(model: str | Path | None, *, revision: str | None = None,
                  download_dir: str | Path | None = None, config_only: bool = False) -> ResolvedModel:
    """The local directory of `model` (see the module docstring); a name that is none of the three is refused.
    `config_only`: a hub model is fetched without its weights (`jengine plan` reads config.json alone)."""
    from jengine.models.demo import DEMO_SERVED_NAME, ensure_demo_model

    if model is None or str(model) == DEMO_SERVED_NAME:
        return ResolvedModel(ensure_demo_model(), DEMO_SERVED_NAME)
    local = Path(model).expanduser()
    if local.exists():  # a checkpoint directory, or a single-file checkpoint (GGUF)
        return ResolvedModel(local, str(model))
    name = str(model)
    if local.is_absolute() or name.startswith((".", "~")) or not _REPO_ID.match(name):
        raise CheckpointError(f"model directory not found: {name} (give a local directory, a GGUF file or a "
                              f"Hugging Face model id such as Qwen/Qwen3-8B)")
    patterns = ("config.json", *SIDE_QUANT_CONFIGS) if config_only else HUB_FILE_PATTERNS
    return ResolvedModel(hub_snapshot(name, revision=revision, download_dir=download_dir, patterns=patterns), name)


def resolve_tokenizer(tokenizer: str | Path | None, *, download_dir: str | Path | None = None) -> str | None:
    """`--tokenizer`: none (the model's), a directory, or a hub id (its main revision) → a local directory."""
    if tokenizer is None:
        return None
    return str(resolve_model(tokenizer, download_dir=download_dir).path)


def hub_snapshot(repo_id: str, *, revision: str | None = None, download_dir: str | Path | None = None,
                 patterns: tuple[str, ...] = HUB_FILE_PATTERNS) -> Path:
    """The cached snapshot of `repo_id` at `revision` (default main), downloaded first unless offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    settings = hub_settings(download_dir)
    where = f"{repo_id}" + (f" at revision {revision}" if revision else "")
    try:
        if settings.offline:
            path = snapshot_download(repo_id, revision=revision, cache_dir=settings.cache_dir, local_files_only=True)
        else:
            logger.info("fetching %s into %s (%s)", where, settings.cache_dir, ", ".join(patterns))
            path = snapshot_download(repo_id, revision=revision, cache_dir=settings.cache_dir,
                                     allow_patterns=list(patterns))
    except LocalEntryNotFoundError:
        raise CheckpointError(f"model {where} is neither a local directory nor in the hub cache {settings.cache_dir}"
                              + (" (HF_HUB_OFFLINE=1: nothing is downloaded)" if settings.offline else
                                 " and could not be downloaded")) from None
    except (HfHubHTTPError, OSError) as error:
        raise CheckpointError(f"could not download model {where}: {error}") from None
    return Path(path)
