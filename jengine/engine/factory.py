"""Assembles an engine from its config: tokenizer, model weights, KV pool, runner, core. Start-up only."""

from __future__ import annotations

import dataclasses
import logging

import jax

from jengine.attention.backend import select_backend
from jengine.config import EngineConfig
from jengine.engine.core import EngineCore
from jengine.errors import ConfigError
from jengine.models.loader import load_model, load_spec
from jengine.models.spec import ModelSpec
from jengine.runner.kv_storage import log_plan, plan_kv_cache
from jengine.runner.runner import ModelRunner
from jengine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineParts:
    core: EngineCore
    tokenizer: Tokenizer
    spec: ModelSpec
    config: EngineConfig  # with max_model_len resolved


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    """The user's limit, or the model's; a limit beyond the model's positions is refused, never silently cut."""
    requested = config.model.max_model_len
    if requested is None:
        return spec.max_position_embeddings
    if requested > spec.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings={spec.max_position_embeddings}"
        )
    return requested


def enable_compilation_cache(cache_dir: str | None) -> None:
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def build_engine(config: EngineConfig) -> EngineParts:
    enable_compilation_cache(config.runner.compilation_cache_dir)
    spec = load_spec(config.model.model)
    config = config.with_max_model_len(resolve_max_model_len(config, spec))
    tokenizer = Tokenizer.from_pretrained(config.model.tokenizer or config.model.model, config.model.chat_template)
    spec, params, dtype = load_model(config.model.model, dtype=config.model.dtype)
    device = jax.devices()[0]
    plan = plan_kv_cache(spec, config.cache, config.scheduler, dtype, device)
    if plan.num_tokens < config.scheduler.max_model_len:
        raise ConfigError(
            f"the KV cache holds {plan.num_tokens} tokens, fewer than one request of max_model_len="
            f"{config.scheduler.max_model_len}; raise num_gpu_blocks_override or lower max_model_len"
        )
    log_plan(plan, config.scheduler.max_model_len)
    backend = select_backend(device.platform, config.runner.attention_backend, head_dim=spec.head_dim)
    runner = ModelRunner(spec, params, dtype, config, plan, backend)
    core = EngineCore(config, runner, plan.num_blocks)
    return EngineParts(core, tokenizer, spec, config)
