"""Engine configuration: frozen dataclasses, composed, validated once; vLLM's flag names.

`EngineConfig.from_kwargs(**kwargs)` is what `LLM(...)` and the CLI both use: every engine flag is a keyword of the
same name with underscores. Unknown keywords and features not available yet are refused, never ignored. This is the
only module that reads environment variables.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from pathlib import Path
from collections.abc import Callable
from typing import Any, Literal

from jengine.errors import ConfigError

# Flags users know from vLLM whose features are not built yet: refused with a clear message instead of ignored.
_NOT_YET_AVAILABLE: dict[str, Any] = {}

# vLLM flags that change nothing here at the values they accept (so vLLM command lines and scripts run as they are);
# other values are refused, naming what this engine does instead.
def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value is v or (type(value) is type(v) and value == v) for v in values)


_ANY_BOOL = _one_of(False, True)
NO_EFFECT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "trust_remote_code": (_ANY_BOOL, "jengine runs its own model code, for the supported architectures only"),
    "disable_log_stats": (_ANY_BOOL, "statistics go to /metrics"),
    "tokenizer_mode": (_one_of(None, "auto", "hf"), "the HF fast tokenizer is used"),
    "enable_chunked_prefill": (_one_of(None, True), "prefills are always chunked by max_num_batched_tokens"),
    "pipeline_parallel_size": (_one_of(1), "use tensor_parallel_size (pipeline parallelism is not built)"),
    "task": (_one_of(None, "auto", "generate"), "jengine generates text"),
    "swap_space": (lambda v: v is None or (isinstance(v, (int, float)) and v >= 0),
                   "preempted requests are recomputed, never swapped to host memory"),
    # a float8 cache always has scales: the checkpoint's k_scale / v_scale, else calibrated on the first prefill
    "calculate_kv_scales": (_ANY_BOOL, "the float8 KV cache's scales come from the checkpoint or the first prefill"),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model: str  # HF model directory (config.json, safetensors, tokenizer)
    tokenizer: str | None = None  # tokenizer directory, default: the model's
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32 (auto: the checkpoint's; float32 → bfloat16 on GPUs)
    seed: int = 0  # engine-level randomness for requests without their own seed
    max_model_len: int | None = None  # context limit (prompt + output); default: the model's max positions
    served_model_name: str | None = None  # name clients use; default: the model path
    served_model_aliases: tuple[str, ...] = ()  # further names requests may use (vLLM's extra served names)
    chat_template: str | None = None  # file or text overriding the tokenizer's chat template
    max_logprobs: int = 20  # cap on logprobs / prompt_logprobs per request
    # sampling defaults where a request leaves a field unset: "auto" = the model's generation_config.json, "vllm" =
    # SamplingParams' own, or a directory holding a generation_config.json (jengine.sampling.defaults)
    generation_config: str = "auto"
    # auto / safetensors: the checkpoint's safetensors files; dummy: random weights from config.json alone (benchmarks
    # of models whose checkpoint is not at hand; a tokenizer is still needed)
    load_format: str = "auto"
    # vLLM's --quantization: None reads the checkpoint's quantization_config (fp8, compressed-tensors 8-bit); "fp8"
    # also quantizes a float checkpoint to float8 at load (per-channel weights, per-token activations)
    quantization: str | None = None


QUANTIZATION_METHODS = (None, "fp8", "compressed-tensors", "modelopt", "awq", "gptq")  # awq/gptq: kept in 4 (or 8) bits
# vLLM's Marlin kernel names for AWQ/GPTQ checkpoints in their usual format: the same checkpoints, jengine's kernels
QUANTIZATION_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV page
    gpu_memory_utilization: float = 0.92  # fraction of device memory for weights + activations + KV cache
    num_gpu_blocks_override: int | None = None  # exact number of KV blocks (any platform)
    enable_prefix_caching: bool = True  # share full blocks between requests by a hash of their tokens
    # auto = the model dtype; fp8 (alias fp8_e4m3) = float8_e4m3fn with per-(layer, KV head) scales from the
    # checkpoint's k_scale/v_scale, else calibrated on the first prefill
    kv_cache_dtype: str = "auto"


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one step (decodes first, then prefill chunks)
    max_num_queued_reqs: int = 1024  # waiting requests a server admits beyond max_num_seqs; one more is refused
    max_model_len: int = 2048  # resolved context limit (filled from ModelConfig and the model)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # devices one replica's model is split over (Megatron-style TP)
    data_parallel_size: int = 1  # engine replicas on disjoint device groups, behind one router
    enable_expert_parallel: bool = False  # MoE experts split whole over the TP devices instead of each split by TP
    # Several hosts, one engine: process 0 schedules and serves, the others run the same steps on their devices.
    # Unset here: $JENGINE_COORDINATOR_ADDRESS / $JENGINE_NUM_PROCESSES / $JENGINE_PROCESS_ID, else a
    # LeaderWorkerSet's $LWS_LEADER_ADDRESS (port $JENGINE_COORDINATOR_PORT, default 8476) / $LWS_GROUP_SIZE /
    # $LWS_WORKER_INDEX.
    coordinator_address: str | None = None  # host:port of process 0's coordination service
    num_processes: int = 1
    process_id: int | None = None


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    # all: compile every shape bucket at start-up; lazy: on first use; auto (the default everywhere): all when a
    # kernel backend runs attention (a GPU), lazy with the jnp reference (its pinned prefill shapes cost a CPU more
    # than they save). Lazy on a GPU compiles mid-run: `jengine bench throughput` on an 8B model made 1,983 output
    # tok/s so (H200, warm compilation cache) against 5,665 with every shape compiled first.
    compile_buckets: Literal["all", "lazy", "auto"] = "auto"
    attention_backend: str = "auto"  # auto | reference | pallas_gpu
    compilation_cache_dir: str | None = None  # JAX persistent compilation cache (`default_compilation_cache_dir`)
    # pipelined steps: step N+1 is dispatched before step N's tokens reach the host (fed to it on the device);
    # False runs each step to completion before the next is scheduled (same outputs, the host time not hidden)
    async_scheduling: bool = True
    # batch-invariant projections and LM head (layers/invariant.py): a request's output does not depend on the
    # batch, chunking or bucket it runs in. None (the default): on where its cost was measured small (a dense float
    # model on one NVIDIA GPU: 6 % of the mixed workload's throughput, benchmarks/README.md), off elsewhere
    # (`factory.py:resolve_deterministic` logs which and why); True or False as asked.
    deterministic: bool | None = None
    # vLLM's: True launches every step's kernels one by one on an NVIDIA GPU, False every step's as XLA's command
    # buffers (CUDA graphs); None (the default): decode-sized steps with command buffers, prompt chunks eagerly
    # (`runner/launch.py` says why)
    enforce_eager: bool | None = None


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: a proposer guesses tokens, the target model verifies them in one step."""

    # ngram (prompt lookup) | draft_model (a smaller model with the same tokenizer) | eagle | eagle3 (a one-layer
    # head over the target's hidden states)
    method: str
    num_speculative_tokens: int  # k: tokens proposed per request per step
    prompt_lookup_min: int = 1  # ngram: shortest suffix n-gram looked up in the request's own tokens
    prompt_lookup_max: int | None = None  # ngram: longest; default prompt_lookup_min's value or 5 when both unset
    model: str | None = None  # draft_model: its directory (same vocabulary as the target); eagle/eagle3: the head's
    # eagle3: the target layers whose input hidden states the head fuses (default: the head's config, else vLLM's
    # 2, L // 2, L - 3)
    eagle_aux_hidden_state_layer_ids: tuple[int, ...] | None = None
    disable_by_batch_size: int | None = None  # no speculation while more requests than this run

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig | None:
        """From a dict (the offline API) or its JSON text (`--speculative-config`); None or {} turns it off."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if not value:
            return None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a dict (or its JSON text)")
        value = dict(value)
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        if method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                              f"got {method!r}")
        value["method"] = method
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown speculative_config field(s): {', '.join(unknown)}")
        if "num_speculative_tokens" not in value:
            raise ConfigError("speculative_config needs num_speculative_tokens")
        if isinstance(value.get("eagle_aux_hidden_state_layer_ids"), list):
            value["eagle_aux_hidden_state_layer_ids"] = tuple(value["eagle_aux_hidden_state_layer_ids"])
        config = cls(**value)
        config.validate()
        return config

    @property
    def lookup_max(self) -> int:
        return self.prompt_lookup_max if self.prompt_lookup_max is not None else max(self.prompt_lookup_min, 5)

    def validate(self) -> None:
        k = self.num_speculative_tokens
        checks = [
            (isinstance(k, int) and 1 <= k <= 16, "num_speculative_tokens must be an integer in [1, 16]"),
            (self.prompt_lookup_min >= 1, "prompt_lookup_min must be >= 1"),
            (self.lookup_max >= self.prompt_lookup_min, "prompt_lookup_max must be >= prompt_lookup_min"),
            (self.method != "draft_model" or bool(self.model), "draft_model needs the draft's directory in 'model'"),
            (self.method not in ("eagle", "eagle3") or bool(self.model),
             f"{self.method} needs the head's directory in 'model'"),
            (self.eagle_aux_hidden_state_layer_ids is None or self.method == "eagle3",
             "eagle_aux_hidden_state_layer_ids applies to eagle3"),
            (self.method != "ngram" or self.model is None, "ngram takes no 'model'"),
            (self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
             "disable_by_batch_size must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


REASONING_PARSERS = ("qwen3", "deepseek_r1")  # the names jengine.tools.reasoning registers
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")  # the names jengine.tools.parsers registers


@dataclasses.dataclass(frozen=True)
class ChatParsingConfig:
    """How chat replies are read by the front ends (vLLM's flags); the engine core never sees text."""

    reasoning_parser: str | None = None  # qwen3 | deepseek_r1: the <think> span goes to `reasoning`
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral | pythonic: the format tool calls are read in
    enable_auto_tool_choice: bool = False  # allow tool_choice "auto" (the default with tools); needs tool_call_parser

    def validate(self) -> None:
        for name, value, known in (("reasoning_parser", self.reasoning_parser, REASONING_PARSERS),
                                   ("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)):
            if value is not None and value not in known:
                raise ConfigError(f"{name}={value!r} is not one of {', '.join(known)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("enable_auto_tool_choice needs tool_call_parser (the format calls are read in)")


RUNTIME_LORA_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "JENGINE_ALLOW_RUNTIME_LORA_UPDATING")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    enable_lora: bool = False  # serve LoRA adapters over the base model
    max_loras: int = 1  # distinct adapters in one step (device slots)
    max_cpu_loras: int | None = None  # adapters kept loaded in host memory (LRU); default and minimum: max_loras
    max_lora_rank: int = 16  # the largest adapter rank; the slots are padded to it
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) adapters loaded at start-up
    # /v1/load_lora_adapter and /v1/unload_lora_adapter allowed (env VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, or
    # JENGINE_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False

    @property
    def cpu_capacity(self) -> int:
        return max(self.max_cpu_loras or self.max_loras, self.max_loras)


def default_compilation_cache_dir() -> str | None:
    """Where every entry point (`LLM` and the CLI alike) keeps its compiled step programs and its tokenizer's class
    unless told: $JENGINE_COMPILATION_CACHE_DIR, else the directory JAX was pointed at ($JAX_COMPILATION_CACHE_DIR),
    else ~/.cache/jengine/jax-cache. Either variable set empty turns the cache off."""
    for name in ("JENGINE_COMPILATION_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR"):
        if name in os.environ:
            return os.environ[name] or None
    return str(Path.home() / ".cache" / "jengine" / "jax-cache")  # looked up here: importing needs no home


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    runner: RunnerConfig
    lora: LoraConfig = LoraConfig()
    chat_parsing: ChatParsingConfig = ChatParsingConfig()
    speculative: SpeculativeConfig | None = None  # speculative decoding; None: off

    @classmethod
    def from_kwargs(cls, model: str | Path, **kwargs: Any) -> EngineConfig:
        """Builds and validates the config from flat keyword arguments (vLLM names)."""
        _refuse_unavailable(kwargs)
        _drop_no_effect(kwargs)
        names = kwargs.get("served_model_name")
        if isinstance(names, (list, tuple)):  # vLLM's several names: the first answers, all are accepted
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ConfigError("served_model_name must be a name or a non-empty list of names")
            kwargs["served_model_name"], kwargs["served_model_aliases"] = names[0], tuple(names[1:])
        if "load_format" in kwargs and kwargs["load_format"] is None:  # vLLM scripts pass None for the default
            del kwargs["load_format"]
        if kwargs.get("quantization") in QUANTIZATION_ALIASES:
            kwargs["quantization"] = QUANTIZATION_ALIASES[kwargs["quantization"]]
        if kwargs.get("quantization") == "gguf":  # vLLM's name for a GGUF file's own types: the file says them
            from jengine.models.gguf.reader import is_gguf

            if not is_gguf(model):
                raise ConfigError(f"quantization='gguf' needs a .gguf file; {model} is not one")
            kwargs["quantization"] = None
        if "seed" in kwargs and kwargs["seed"] is None:  # vLLM's seed=None: not reproducible from run to run
            kwargs["seed"] = secrets.randbits(63)
        speculative = SpeculativeConfig.from_value(kwargs.pop("speculative_config", None))
        parts = {}
        for name, part in (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig),
                           ("parallel", ParallelConfig), ("runner", RunnerConfig), ("lora", LoraConfig),
                           ("chat_parsing", ChatParsingConfig)):
            fields = {f.name for f in dataclasses.fields(part)} - {"model"}
            parts[name] = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
        if kwargs:
            raise ConfigError(f"unknown engine argument(s): {', '.join(sorted(kwargs))} (jengine takes vLLM's names "
                              f"for the features it has; `jengine serve --help` lists them)")
        parts["runner"].setdefault("compilation_cache_dir", default_compilation_cache_dir())
        parts["parallel"] = _multi_host_from_environment(parts["parallel"])
        model_part = ModelConfig(model=str(model), **parts["model"])
        sched = dict(parts["scheduler"], max_model_len=model_part.max_model_len or 0)
        config = cls(model_part, CacheConfig(**parts["cache"]), SchedulerConfig(**sched),
                     ParallelConfig(**parts["parallel"]), RunnerConfig(**parts["runner"]),
                     lora=_lora_config(parts["lora"]), chat_parsing=ChatParsingConfig(**parts["chat_parsing"]),
                     speculative=speculative)
        config.validate()
        return config

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """The resolved context limit (known once the model config is read)."""
        return dataclasses.replace(
            self, model=dataclasses.replace(self.model, max_model_len=max_model_len),
            scheduler=dataclasses.replace(self.scheduler, max_model_len=max_model_len),
        )

    def validate(self) -> None:
        checks = [
            (self.cache.block_size in (8, 16, 32, 64, 128, 256), "block_size must be one of 8, 16, 32, 64, 128, 256"),
            (0 < self.cache.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"),
            (self.cache.num_gpu_blocks_override is None or self.cache.num_gpu_blocks_override > 0,
             "num_gpu_blocks_override must be positive"),
            (self.cache.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype={self.cache.kv_cache_dtype!r} is not supported; choose {', '.join(KV_CACHE_DTYPES)}"),
            (self.scheduler.max_num_seqs > 0, "max_num_seqs must be positive"),
            (self.scheduler.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive"),
            (self.scheduler.max_num_queued_reqs >= 0, "max_num_queued_reqs must be >= 0"),
            (self.model.max_model_len is None or self.model.max_model_len > 0, "max_model_len must be positive"),
            (self.model.max_logprobs >= 0, "max_logprobs must be >= 0"),
            (self.model.quantization in QUANTIZATION_METHODS,
             f"quantization={self.model.quantization!r} is not supported; choose fp8, compressed-tensors or "
             "modelopt (8-bit checkpoints), awq or gptq (awq_marlin, gptq_marlin: the same), gguf (a .gguf file), "
             "or leave it unset to read the checkpoint's quantization_config"),
            (self.model.load_format in LOAD_FORMATS,
             f"load_format={self.model.load_format!r} is not supported: choose {', '.join(LOAD_FORMATS)} (weights "
             "load from safetensors only; pickle files are never opened)"),
            (self.parallel.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
            (self.parallel.data_parallel_size >= 1, "data_parallel_size must be >= 1"),
            (self.parallel.num_processes >= 1, "num_processes must be >= 1"),
            (self.parallel.num_processes == 1 or self.parallel.data_parallel_size == 1,
             "data_parallel_size > 1 runs on one host; across hosts, put `jengine openai --engine` before engines"),
            (self.runner.compile_buckets in ("all", "lazy", "auto"), "compile_buckets must be 'all', 'lazy' or 'auto'"),
            (self.speculative is None or self.parallel.num_processes == 1,
             "speculative decoding runs on one host (num_processes=1)"),


            *_lora_checks(self.lora, self.parallel),
            *_deterministic_checks(self),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self.chat_parsing.validate()


def _deterministic_checks(config: EngineConfig) -> list[tuple[bool, str]]:
    """What `deterministic` cannot be combined with yet, by name."""
    if config.runner.deterministic is not True:
        return []
    why = "deterministic=True (batch-invariant matmuls) "
    return [
        (config.speculative is None, why + "does not combine with speculative decoding yet"),
        (not config.lora.enable_lora, why + "does not combine with LoRA adapters yet"),
        (config.model.quantization is None, why + "takes float checkpoints only (quantized matmuls have their own "
                                                  "kernels)"),
    ]


API_KEY_ENV = "JENGINE_API_KEY"
METRICS_PREFIXES = ("jengine", "vllm", "both")


def _float_env(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        raise ConfigError(f"${name} must be a number of seconds, got {os.environ[name]!r}") from None


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The HTTP/gRPC front ends of `jengine serve` / `jengine openai` (the engine's own limits live in EngineConfig)."""

    host: str = "0.0.0.0"  # vLLM's default: every interface
    port: int = 8000  # OpenAI HTTP port
    grpc_port: int = 50051  # gRPC port; 0 = no gRPC service
    api_key: str | None = None  # Bearer key for every route but /health, /metrics, /version (env JENGINE_API_KEY)
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413
    max_header_bytes: int = 64 * 1024  # request line plus header fields, together; more (or over 128 fields) get 431
    request_timeout: float | None = None  # seconds an HTTP generation may run, then 504 and abort; None: no limit
    drain_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests before closing connections
    max_n: int = 16  # cap on `n` per request (vLLM's unbounded fan-out was CVE-2026-34756)
    # CORS, vLLM's defaults: browsers may call the API from any origin
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # /metrics names: "jengine" (jengine:...), "vllm" (vllm:..., so a vLLM dashboard works unchanged) or "both"
    metrics_prefix: str = "jengine"
    log_requests: bool = True  # one log line per finished request (--disable-log-requests: none)
    # seconds between the log's stats lines (throughput, running, waiting, KV usage, prefix hits); 0 = none
    # (--disable-log-stats); unset in from_kwargs: $JENGINE_LOG_STATS_INTERVAL, else 10 as vLLM
    log_stats_interval: float = 10.0

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerConfig:
        """Validated config; an api_key left unset comes from $JENGINE_API_KEY (an empty value means none)."""
        if kwargs.get("api_key") is None:
            kwargs["api_key"] = os.environ.get(API_KEY_ENV) or None
        if kwargs.get("log_stats_interval") is None:
            kwargs["log_stats_interval"] = _float_env("JENGINE_LOG_STATS_INTERVAL", 10.0)
        config = cls(**kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        checks = [
            (0 <= self.port < 65536 and 0 <= self.grpc_port < 65536, "ports must be in [0, 65535]"),
            (self.api_key is None or len(self.api_key) > 0, "api_key must not be empty"),
            (self.max_body_bytes > 0, "max_body_bytes must be positive"),
            (self.max_header_bytes >= 1024, "max_header_bytes must be at least 1024"),
            (self.request_timeout is None or self.request_timeout > 0, "request_timeout must be positive (or unset)"),
            (self.drain_timeout >= 0, "drain_timeout must be >= 0"),
            (1 <= self.max_n <= 1024, "max_n must be in [1, 1024]"),
            (self.metrics_prefix in METRICS_PREFIXES,
             f"metrics_prefix must be one of {', '.join(METRICS_PREFIXES)}, got {self.metrics_prefix!r}"),
            (self.log_stats_interval >= 0, "log_stats_interval must be >= 0 (0: no stats lines)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


_TRUE_WORDS = ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class HubSettings:
    """Where HF Hub models are cached and whether the network may be used (huggingface_hub's variables)."""

    cache_dir: Path  # --download-dir, else $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub
    offline: bool  # $HF_HUB_OFFLINE=1: only the local cache is read


def hub_settings(download_dir: str | Path | None = None) -> HubSettings:
    env = os.environ
    if download_dir:
        cache = Path(download_dir)
    elif env.get("HF_HUB_CACHE"):
        cache = Path(env["HF_HUB_CACHE"])
    else:
        cache = Path(env.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub"
    return HubSettings(cache.expanduser(), env.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE_WORDS)


def _lora_config(kwargs: dict[str, Any]) -> LoraConfig:
    """LoRA settings; `lora_modules` as vLLM takes them: "name=path" strings, {"name", "path"} dicts, or pairs."""
    modules = kwargs.get("lora_modules") or ()
    kwargs["lora_modules"] = tuple(_lora_module(m) for m in ([modules] if isinstance(modules, str) else modules))
    kwargs.setdefault("allow_runtime_lora_updating", any(
        os.environ.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_LORA_ENV))
    return LoraConfig(**kwargs)


def _lora_module(module: Any) -> tuple[str, str]:
    if isinstance(module, str) and "=" in module:
        name, path = module.split("=", 1)
    elif isinstance(module, dict) and {"name", "path"} <= set(module):
        name, path = module["name"], module["path"]
    elif isinstance(module, (tuple, list)) and len(module) == 2:
        name, path = module
    else:
        raise ConfigError(f"lora_modules entries are name=path (or {{\"name\", \"path\"}}), got {module!r}")
    if not name or not path:
        raise ConfigError(f"lora_modules entry {module!r} needs a name and a path")
    return str(name), str(path)


def _lora_checks(lora: LoraConfig, parallel: ParallelConfig) -> list[tuple[bool, str]]:
    single = parallel.tensor_parallel_size == 1 and parallel.data_parallel_size == 1 and parallel.num_processes == 1
    return [
        (lora.max_loras >= 1, "max_loras must be >= 1"),
        (lora.max_cpu_loras is None or lora.max_cpu_loras >= lora.max_loras, "max_cpu_loras must be >= max_loras"),
        (1 <= lora.max_lora_rank <= 512, "max_lora_rank must be in [1, 512]"),
        (lora.enable_lora or not lora.lora_modules, "lora_modules needs enable_lora"),
        (not lora.enable_lora or single,
         "enable_lora runs on one device for now (tensor_parallel_size, data_parallel_size and num_processes 1)"),
    ]


def _multi_host_from_environment(parallel: dict[str, Any]) -> dict[str, Any]:
    """Flags win; then jengine's variables; then a LeaderWorkerSet's (one pod per host, the leader is process 0)."""
    env = os.environ
    lws_leader = env.get("LWS_LEADER_ADDRESS")
    lws_address = f"{lws_leader}:{env.get('JENGINE_COORDINATOR_PORT', '8476')}" if lws_leader else None
    address = parallel.get("coordinator_address") or env.get("JENGINE_COORDINATOR_ADDRESS") or lws_address
    count = parallel.get("num_processes") or env.get("JENGINE_NUM_PROCESSES") or env.get("LWS_GROUP_SIZE") or 1
    process_id = parallel.get("process_id")
    if process_id is None:
        process_id = env.get("JENGINE_PROCESS_ID", env.get("LWS_WORKER_INDEX"))
    try:
        return parallel | {"coordinator_address": address, "num_processes": int(count),
                           "process_id": None if process_id is None else int(process_id)}
    except ValueError as e:
        raise ConfigError(f"num_processes and process_id must be integers ({e})") from None


def _drop_no_effect(kwargs: dict[str, Any]) -> None:
    for name, (accepted, instead) in NO_EFFECT.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if not accepted(value):
                raise ConfigError(f"{name}={value!r} is not supported: {instead}")


def _refuse_unavailable(kwargs: dict[str, Any]) -> None:
    for name, inactive in _NOT_YET_AVAILABLE.items():
        if name in kwargs:
            if kwargs[name] not in (inactive, None, False):
                raise ConfigError(f"{name} is not available in this version of jengine yet")
            kwargs.pop(name)
