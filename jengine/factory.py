"""Assembles an engine from its config: tokenizer, model weights, KV pool, runner, core. Start-up only."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import time
from collections.abc import Sequence
from typing import Any
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp

from jengine.attention.backend import has_invariant_path, select_backend
from jengine.config import EngineConfig, ModelConfig
from jengine.engine.core import EngineCore
from jengine.errors import CheckpointError, ConfigError
from jengine.layers.quant import workspace_bytes
from jengine.lora.device import DeviceLoraSlots
from jengine.lora.host_cache import AdapterCache
from jengine.lora.peft import LoraAdapter, read_adapter
from jengine.lora.request import LoRARequest
from jengine.lora.runner_slots import RunnerLora
from jengine.models.dummy import dummy_model
from jengine.models.formats import generation_config_dir, tokenizer_dir as resolve_tokenizer_dir
from jengine.models.loader import load_model, load_spec
from jengine.models.spec import ModelSpec
from jengine.parallel.distributed import agree_across_processes
from jengine.parallel.distributed import initialize as initialize_processes
from jengine.parallel.mesh import build_mesh, replica_devices
from jengine.parallel.sharding import ParallelLayout, plan_layout
from jengine.parallel.step_feed import StepPublisher
from jengine.runner.device_pool import size_pool
from jengine.runner.kv_storage import log_plan, plan_kv_cache
from jengine.runner.multi_process import PublishingRunner
from jengine.runner.program_prefetch import start_signature
from jengine.runner.program_store import ProgramStore
from jengine.runner.protocol import StepRunner
from jengine.runner.runner import ModelRunner
from jengine.sampling.defaults import load_sampling_defaults
from jengine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineParts:
    core: EngineCore
    tokenizer: Tokenizer
    spec: ModelSpec
    config: EngineConfig  # with max_model_len resolved
    # SamplingParams keywords for the fields a request leaves unset (jengine.sampling.defaults), read once here
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)


TOKENIZER_WAIT_LOGGED_S = 0.2  # a wait this long is worth naming in the start-up log
KERNEL_MODULE = "jengine.attention.pallas"  # the attention kernels, imported at start-up beside the weights


def model_context_limit(spec: ModelSpec) -> tuple[int, str]:
    """(positions the model serves, why): max_position_embeddings, stretched by a rope scaling that exists to extend
    it, as vLLM derives it: YaRN to original_max_position_embeddings × factor (Qwen's 32k → 131k recipe), linear
    interpolation to max_position_embeddings × factor."""
    rope, positions = spec.rope, spec.max_position_embeddings
    if rope.rope_type == "yarn" and rope.original_max_position_embeddings:
        stretched = int(rope.original_max_position_embeddings * rope.factor)
        if stretched > positions:
            return stretched, (f"YaRN: original_max_position_embeddings={rope.original_max_position_embeddings} × "
                               f"factor {rope.factor:g}")
    if rope.rope_type == "linear" and rope.factor > 1:
        return int(positions * rope.factor), (f"linear rope scaling: max_position_embeddings={positions} × "
                                              f"{rope.factor:g}")
    return positions, f"max_position_embeddings={positions}"


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    """The user's limit, or the model's; a limit beyond the model's positions is refused, never silently cut."""
    requested = config.model.max_model_len
    limit, source = model_context_limit(spec)
    if requested is None:
        return limit
    if requested > limit:
        raise ConfigError(f"max_model_len={requested} exceeds the model's context of {limit} ({source})")
    return requested


COMPILATION_CACHE_MAX_BYTES = 64 << 30


def enable_compilation_cache(cache_dir: str | None) -> None:
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        if jax.config.jax_compilation_cache_max_size == -1:
            # Replicas and processes sharing a cache directory: unlimited, JAX writes entries unlocked and a
            # process can read one half-written; a size limit makes every read and write hold the cache's file lock
            jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_MAX_BYTES)


def check_tokenizer(tokenizer_dir: str, load_format: str) -> None:
    """Random weights still need a tokenizer (as vLLM's dummy format does); a directory holding only config.json is
    told how to give one."""
    try:
        Tokenizer.check_files(tokenizer_dir)
    except CheckpointError as error:
        if load_format != "dummy":
            raise
        raise CheckpointError(f"{error}. load_format='dummy' makes random weights but still needs a tokenizer: pass "
                              "tokenizer=DIR (--tokenizer DIR), or copy tokenizer files into the model directory "
                              "(scripts/moe_shapes.py writes a small one)") from None


def load_weights(model: ModelConfig, layout: ParallelLayout) -> tuple[ModelSpec, dict, jax.numpy.dtype]:
    """The checkpoint's weights placed by `layout`, or random ones made in place (`load_format="dummy"`)."""
    placement = dict(dtype=model.dtype, sharding=layout.param_sharding, kv_head_repeat=layout.kv_head_repeat,
                     projection_shards=layout.size)
    if model.load_format == "dummy":
        return dummy_model(model.model, seed=model.seed, quantization=model.quantization, **placement)
    return load_model(model.model, quantization=model.quantization, **placement)


def log_weights(params: dict, seconds: float) -> None:
    """How many bytes the weights take on the device and how fast they got there (start-up is mostly this and the
    step programs; `engine built in` says the rest)."""
    size = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    shown = f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
    logger.info("weights: %s on the device %.1f s after start (%.2f GB/s, checkpoint read, cast and placed)",
                shown, seconds, size / 1e9 / max(seconds, 1e-9))


def log_unused_kv_scales(params: dict, kv_cache_dtype: str) -> None:
    """A checkpoint made for a float8 KV cache served with the model's dtype: its scales are loaded, not used."""
    if kv_cache_dtype == "auto" and any("kv_scale" in layer for layer in params["layers"]):
        logger.info("the checkpoint's KV-cache scales go unused: the cache stores the model's dtype "
                    "(--kv-cache-dtype fp8 stores float8 with them)")


def is_quantized(params: dict) -> bool:
    from jengine.layers.quant import QuantizedWeight
    from jengine.layers.quant4 import Int4Experts, Int4Weight

    return any(isinstance(leaf, (QuantizedWeight, Int4Weight, Int4Experts))
               for layer in params["layers"] for leaf in layer.values())


def deterministic_params(params: dict, spec: ModelSpec, layout: ParallelLayout, platform: str) -> dict:
    """The projections and LM head made batch-invariant (`layers/invariant.py`), split over `layout`'s mesh as
    the weights are; a quantized checkpoint (read from its own quantization_config) is refused by name."""
    from jengine.layers.invariant import invariant_impl, make_invariant

    if is_quantized(params):
        raise ConfigError("deterministic=True (batch-invariant matmuls) takes float checkpoints only: this one is "
                          "quantized")
    return make_invariant(params, invariant_impl(platform), spec.tie_word_embeddings, layout)


def auto_deterministic_blocker(config: EngineConfig, spec: ModelSpec, params: dict, layout: ParallelLayout,
                               dtype, platform: str) -> str | None:
    """Why `deterministic=None` (auto) leaves batch invariance off here, or None where it turns it on: only where
    its cost was measured small, a dense 16-bit model on one NVIDIA GPU with the Pallas attention kernels."""

    def kernels_serve_it() -> bool:  # else the backend would fall back to the reference at trace time
        from jengine.attention.pallas import supports  # the kernels' import (~0.3 s) only where they may run

        backend = select_backend(platform, config.runner.attention_backend, head_dim=spec.head_dim, mesh=layout.mesh)
        return has_invariant_path(backend) and supports(
            head_dim=spec.head_dim, block_size=config.cache.block_size, num_q_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads, dtype=dtype)

    checks = (  # in order; each a (blocked?, why) pair, the later ones only asked when the earlier pass
        (lambda: platform != "gpu",
         f"{platform}: XLA's reductions there already keep a row's result whatever its batch"),
        (lambda: config.speculative is not None, "speculative decoding"),
        (lambda: config.lora.enable_lora, "LoRA adapters"),
        (lambda: config.model.quantization is not None or is_quantized(params), "a quantized checkpoint"),
        (lambda: layout.size > 1, "tensor parallelism (its cost there is not measured)"),
        (lambda: "moe" in spec.mlp_kinds, "a MoE model (its cost there is not measured)"),
        (lambda: dtype not in (jnp.bfloat16, jnp.float16), f"{jnp.dtype(dtype).name} weights"),
        (lambda: not kernels_serve_it(), "the Pallas attention kernels do not serve this model"),
    )
    return next((why for blocked, why in checks if blocked()), None)


def resolve_deterministic(config: EngineConfig, spec: ModelSpec, params: dict, layout: ParallelLayout, dtype,
                          platform: str) -> bool:
    """`deterministic` as asked, or for None (the default) on where `auto_deterministic_blocker` finds nothing."""
    if config.runner.deterministic is not None:
        return config.runner.deterministic
    blocker = auto_deterministic_blocker(config, spec, params, layout, dtype, platform)
    if blocker is None:
        logger.info("deterministic output on: a request's tokens and logprobs do not depend on its batch "
                    "(batch-invariant kernels, about 6 %% of throughput; --no-deterministic turns them off)")
    elif platform != "cpu":
        logger.info("deterministic output off (%s); --deterministic asks for it", blocker)
    return blocker is None


def build_engine(config: EngineConfig, devices: Sequence[jax.Device] | None = None) -> EngineParts:
    """One engine replica on `devices` (default: the first `tensor_parallel_size` devices), its model split over
    them by tensor (and expert) parallelism."""
    started = time.perf_counter()
    size_pool(config.cache.gpu_memory_utilization)  # before JAX's GPU backend starts
    initialize_processes(config.parallel)  # before any device is touched
    enable_compilation_cache(config.runner.compilation_cache_dir)
    spec = load_spec(config.model.model)
    config = config.with_max_model_len(resolve_max_model_len(config, spec))
    parallel = config.parallel
    if devices is None:
        devices = replica_devices(parallel.tensor_parallel_size)
    elif len(devices) != parallel.tensor_parallel_size:
        raise ConfigError(f"tensor_parallel_size={parallel.tensor_parallel_size} but {len(devices)} devices given")
    layout = plan_layout(spec, build_mesh(devices), parallel.enable_expert_parallel)
    tokenizer_dir = str(resolve_tokenizer_dir(config.model.model, config.model.tokenizer))
    check_tokenizer(tokenizer_dir, config.model.load_format)  # a missing tokenizer fails before any weight is read
    # a malformed generation_config.json fails before any weight is read, as a missing tokenizer does
    sampling_defaults = load_sampling_defaults(generation_config_dir(config.model.model, tokenizer_dir),
                                               config.model.generation_config)
    # Loading the tokenizer imports transformers (and, the first time, torch where installed): seconds that overlap
    # the weights' and the step programs'. The compilation cache also remembers the tokenizer's class, so restarts
    # skip torch. On an accelerator the attention kernels' modules (Pallas, Mosaic GPU: ~0.5 s) are imported
    # beside the weights too, instead of when the backend is chosen after them.
    pool = ThreadPoolExecutor(2, thread_name_prefix="start-up")
    try:
        pending_tokenizer = pool.submit(Tokenizer.from_pretrained, tokenizer_dir, config.model.chat_template,
                                        config.runner.compilation_cache_dir)
        if devices[0].platform != "cpu":
            pool.submit(importlib.import_module, KERNEL_MODULE)  # an error surfaces where the backend imports it
        core, spec, marks = build_core(config, devices, layout, started)
        built = time.perf_counter()
        tokenizer = pending_tokenizer.result()
    finally:
        pool.shutdown(wait=False)  # on an error the load runs out on its own
    waited = time.perf_counter() - built
    if waited > TOKENIZER_WAIT_LOGGED_S:
        logger.info("start-up waited %.1f s for the tokenizer after the step programs", waited)
    logger.info("engine built in %.1f s: %.1f s to the weights on the device, %.1f s planning, %.1f s for the KV "
                "pool and the step programs", time.perf_counter() - started, *marks)
    return EngineParts(core, tokenizer, spec, config, sampling_defaults)


def build_core(config: EngineConfig, devices: Sequence[jax.Device], layout: ParallelLayout,
               started: float) -> tuple[EngineCore, ModelSpec, tuple[float, float, float]]:
    """The engine core on `devices`: weights loaded (and made batch-invariant where asked), the KV pool planned, the
    step programs built (the last start's saved ones loading beside the weights). Returns it, the model's spec as
    the checkpoint gave it, and the seconds since `started` to the weights on the device, then planning, then the
    runner."""
    store = ProgramStore.beside(config.runner.compilation_cache_dir, devices[0].platform)
    if store is None:
        return _build_core(config, devices, layout, started, None)
    with store.prefetching(start_signature(config, list(layout.mesh.devices.flat))):
        return _build_core(config, devices, layout, started, store)


def _build_core(config: EngineConfig, devices: Sequence[jax.Device], layout: ParallelLayout, started: float,
                store: ProgramStore | None) -> tuple[EngineCore, ModelSpec, tuple[float, float, float]]:
    parallel = config.parallel
    spec, params, dtype = load_weights(config.model, layout)
    log_weights(params, time.perf_counter() - started)
    log_unused_kv_scales(params, config.cache.kv_cache_dtype)
    weights_at = time.perf_counter()
    device = next(d for d in devices if d.process_index == jax.process_index())  # memory stats: local only
    deterministic = resolve_deterministic(config, spec, params, layout, dtype, device.platform)
    if deterministic:
        params = deterministic_params(params, spec, layout, device.platform)
    draft = head = None
    method = None if config.speculative is None else config.speculative.method
    if method == "draft_model":
        from jengine.spec_decode.draft_loading import load_draft  # before the pool is sized: its weights count
        draft = load_draft(config, spec, layout, load_weights)
    elif method in ("eagle", "eagle3"):
        from jengine.spec_decode.eagle_loading import load_eagle_head
        head = load_eagle_head(config, spec, params, layout, dtype)
    # before the KV pool takes the rest
    adapters, runner_lora, params = build_lora(config, spec, dtype, layout.replicated, params)
    plan = agree_across_processes(plan_kv_cache(spec, config.cache, config.scheduler, dtype, device,
                                                kv_shards=layout.size,
                                                workspace=workspace_bytes(params, dtype, device.platform)
                                                // layout.size))
    if plan.num_tokens < config.scheduler.max_model_len:
        raise ConfigError(
            f"the KV cache holds {plan.num_tokens} tokens, fewer than one request of max_model_len="
            f"{config.scheduler.max_model_len}; raise num_gpu_blocks_override or lower max_model_len"
        )
    plan, proposer = build_model_proposer(config, draft, head, plan, layout, device.platform)
    log_plan(plan, config.scheduler.max_model_len)
    backend = select_backend(device.platform, config.runner.attention_backend, head_dim=spec.head_dim,
                             mesh=layout.mesh, deterministic=deterministic,
                             max_model_len=config.scheduler.max_model_len)
    runner_at = time.perf_counter()
    runner: StepRunner = ModelRunner(spec, params, dtype, config, plan, backend, layout, runner_lora, proposer,
                                     store)
    runner_s = time.perf_counter() - runner_at
    if parallel.num_processes > 1 and jax.process_index() == 0:  # the workers replay process 0's runner calls
        runner = PublishingRunner(runner, StepPublisher())
    core = EngineCore(config, runner, plan.num_blocks, adapters)
    for name, path in config.lora.lora_modules:  # --lora-modules: read and checked before serving starts
        core.add_lora(LoRARequest(name, index_of_lora(core), path))
    return core, spec, (weights_at - started, runner_at - weights_at, runner_s)


def build_model_proposer(config: EngineConfig, draft, head, plan, layout, platform: str) -> tuple:
    """(the KV plan with the pool shared, the proposer) for a draft model or an EAGLE head; (plan, None) without."""
    if draft is None and head is None:
        return plan, None
    from jengine.spec_decode.draft_loading import build_draft_proposer, share_pool

    if draft is not None:
        plan = share_pool(plan, draft.spec, "draft model")
        return plan, build_draft_proposer(config, draft, plan, layout, platform)
    from jengine.spec_decode.eagle_loading import build_eagle_proposer

    plan = share_pool(plan, head.spec, f"{config.speculative.method} head")
    return plan, build_eagle_proposer(config, head, plan, layout, platform)


def build_lora(config: EngineConfig, spec: ModelSpec, dtype, sharding, params: dict
               ) -> tuple[AdapterCache | None, RunnerLora | None, dict]:
    """The host cache of adapters and the runner's device slots, when LoRA is enabled, and the model weights (the
    plain projection weights widened in place by the slots' A columns, `DeviceLoraSlots.carry_in`)."""
    lora = config.lora
    if not lora.enable_lora:
        return None, None, params

    def read(request: LoRARequest) -> LoraAdapter:
        return read_adapter(request.lora_name, request.lora_path, spec, lora.max_lora_rank)

    cache = AdapterCache(lora.cpu_capacity, read)
    slots = DeviceLoraSlots(spec, lora.max_loras, lora.max_lora_rank, dtype, sharding)
    return cache, RunnerLora(slots, cache), slots.carry_in(params)


def index_of_lora(core: EngineCore) -> int:
    """A fresh `lora_int_id` for an adapter added by name and path alone."""
    return max((r.lora_int_id for r in core.list_loras()), default=0) + 1


def build_replicated_engine(config: EngineConfig) -> EngineParts:
    """`data_parallel_size` replicas on disjoint device groups behind one `ReplicatedCore` (the notebook API's
    data parallelism; servers put the router before separate engines instead)."""
    from jengine.engine.replicated_core import ReplicatedCore

    parallel = config.parallel
    size_pool(config.cache.gpu_memory_utilization)  # before replica_devices starts JAX's backends
    replicas = [build_engine(config, replica_devices(parallel.tensor_parallel_size, parallel.data_parallel_size, i))
                for i in range(parallel.data_parallel_size)]
    core = ReplicatedCore([parts.core for parts in replicas], config.cache.block_size)
    return dataclasses.replace(replicas[0], core=core)
