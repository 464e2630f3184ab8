"""Start-up of the draft-model proposer: its weights, its KV cache over the target's block ids, its step model."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from jengine.attention.backend import AttentionBackend, select_backend
from jengine.attention.kv_cache import KVCache
from jengine.config import EngineConfig, ModelConfig
from jengine.errors import ConfigError
from jengine.models.spec import ModelSpec
from jengine.parallel.sharding import ParallelLayout
from jengine.runner.kv_storage import KVPlan, allocate, bytes_per_block
from jengine.runner.step import StepModel
from jengine.spec_decode.chain import scratch_blocks_per_row
from jengine.spec_decode.draft_model import DraftModelProposer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadedDraft:
    spec: ModelSpec
    params: dict
    dtype: object


def load_draft(config: EngineConfig, target: ModelSpec, layout: ParallelLayout,
               load_weights: Callable[[ModelConfig, ParallelLayout], tuple]) -> LoadedDraft:
    """The draft's weights, loaded as the target's are (`load_weights`: the factory's, so `load_format` applies
    to both), checked against the target (same vocabulary: its ids are the target's)."""
    if config.parallel.tensor_parallel_size != 1:
        raise ConfigError("draft_model speculation runs with tensor_parallel_size=1")
    draft_dir = config.speculative.model
    spec, params, dtype = load_weights(dataclasses.replace(config.model, model=draft_dir), layout)
    if spec.vocab_size != target.vocab_size:
        raise ConfigError(f"the draft model {draft_dir} has a vocabulary of {spec.vocab_size} tokens, the target "
                          f"{target.vocab_size}: a draft must share the target's tokenizer")
    return LoadedDraft(spec, params, dtype)


def share_pool(plan: KVPlan, proposer_spec: ModelSpec, name: str) -> KVPlan:
    """A pool sized from device memory holds the target's and the proposer's K/V per block: the target's share
    shrinks to fit."""
    if not plan.source.startswith("gpu_memory_utilization"):
        return plan
    proposer_bytes = bytes_per_block(proposer_spec, plan.block_size, plan.kv_dtype)
    blocks = plan.num_blocks * plan.bytes_per_block // (plan.bytes_per_block + proposer_bytes)
    return dataclasses.replace(plan, num_blocks=int(blocks), source=plan.source + f", shared with the {name}")


def proposer_cache(config: EngineConfig, spec: ModelSpec, plan: KVPlan, layout: ParallelLayout,
                   platform: str) -> tuple[KVCache, AttentionBackend]:
    """A proposer's own paged KV over the target's block ids, then its rows' scratch blocks, and its backend."""
    k, size = config.speculative.num_speculative_tokens, plan.block_size
    scratch = scratch_blocks_per_row(k, size) * config.scheduler.max_num_seqs
    own_plan = dataclasses.replace(plan, num_blocks=plan.num_blocks + scratch,
                                   bytes_per_block=bytes_per_block(spec, size, plan.kv_dtype))
    backend = select_backend(platform, config.runner.attention_backend, head_dim=spec.head_dim, mesh=layout.mesh)
    logger.info("%s proposer: %d layer(s), KV over the target's %d blocks (+%d scratch)", config.speculative.method,
                spec.num_layers, plan.num_blocks, scratch)
    return allocate(spec, own_plan, layout.kv_cache_sharding), backend


def build_draft_proposer(config: EngineConfig, draft: LoadedDraft, plan: KVPlan, layout: ParallelLayout,
                         platform: str) -> DraftModelProposer:
    kv, backend = proposer_cache(config, draft.spec, plan, layout, platform)
    return DraftModelProposer(StepModel(draft.spec, backend, None), draft.params, kv,
                              config.speculative.num_speculative_tokens, plan.block_size, plan.num_blocks,
                              config.scheduler.max_model_len)
