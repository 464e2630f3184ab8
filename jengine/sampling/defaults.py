"""The model's own sampling defaults, from its generation_config.json, as vLLM's `--generation-config auto` takes them.

Instruct models ship their recommended sampling (Llama 3: temperature 0.6, top_p 0.9; Qwen: temperature 0.7, top_p
0.8, top_k 20, repetition_penalty 1.05). They apply wherever a request leaves the field unset: `LLM.generate` without
SamplingParams (`LLM.get_default_sampling_params()`), and OpenAI requests that omit the field; a field the request
sets always wins. `max_new_tokens` becomes the default max_tokens of offline generation (a server keeps its own:
only after the chat template is it known whether the model's number fits the context): `max_tokens_when_unset` is
the one rule, and the front (`InputProcessor`) the one place that turns "until the context ends" into a number.
`generation_config="vllm"` ignores the file (SamplingParams' own defaults); any other value names a directory holding
a generation_config.json.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from jengine.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

# generation_config.json field → SamplingParams field, and the type it must have
FIELDS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
    "min_p": ("min_p", float), "repetition_penalty": ("repetition_penalty", float),
    "max_new_tokens": ("max_tokens", int),
}
IGNORE = "vllm"  # vLLM's name for "SamplingParams' own defaults"
LEGACY_MAX_TOKENS = 16  # SamplingParams' and /v1/completions' default: vLLM's and OpenAI's legacy value

Api = Literal["offline", "completions", "chat", "grpc"]


def max_tokens_when_unset(defaults: Mapping[str, Any], api: Api) -> int | None:
    """The max_tokens of a request that sets none, by the API it came through: offline (`LLM`), the model's
    max_new_tokens, else 16; /v1/completions, 16; /v1/chat/completions and gRPC, None: what the context leaves after
    the prompt, which the front resolves once the prompt (its chat template rendered) is tokenized."""
    if api == "offline":
        return defaults.get("max_tokens", LEGACY_MAX_TOKENS)
    return LEGACY_MAX_TOKENS if api == "completions" else None


def load_sampling_defaults(model_dir: str | Path, source: str = "auto") -> dict[str, Any]:
    """SamplingParams keywords from the generation config (`source`: "auto" = the model's, "vllm" = none, or a
    directory); an absent file gives none, a malformed one is a CheckpointError naming the field."""
    if source == IGNORE:
        return {}
    directory = Path(model_dir) if source == "auto" else Path(source)
    if source != "auto" and not (directory / "generation_config.json").is_file():
        raise ConfigError(f"generation_config={source!r}: no generation_config.json there (or use 'auto' or "
                          f"'{IGNORE}')")
    path = directory / "generation_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from exc
    defaults = {target: _checked(path, name, config[name], kind)
                for name, (target, kind) in FIELDS.items() if config.get(name) is not None}
    if defaults:
        shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
        logger.info("sampling defaults from %s: %s (a request's own values win; generation_config='%s' ignores "
                    "them)", path, shown, IGNORE)
    return defaults


def _checked(path: Path, name: str, value: Any, kind: type) -> Any:
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or (kind is int and not float(value).is_integer()):
        raise CheckpointError(f"{path}: {name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)
