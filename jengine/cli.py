"""The `jengine` command: `generate` (prompts → completions on stdout), `serve` (the OpenAI HTTP API and the gRPC
service over one in-process engine, or `--data-parallel-size` of them behind the router), `openai` (the HTTP API
alone, over one running engine's gRPC service or several behind the router).

Engine flags carry vLLM's names (`--max-model-len`, `--max-num-seqs`, `--block-size`, ...) and map one to one onto
`EngineConfig.from_kwargs`. Commands in `_NOT_BUILT` (none now) meet a clear message until they exist, and flags for
features not built yet are refused, never ignored. `bench {throughput,latency,serve}` lives in `jengine.bench`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jengine.config import EngineConfig, ServerConfig
    from jengine.clients.protocol import EngineClient

logger = logging.getLogger(__name__)

_NOT_BUILT: dict[str, str] = {}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags shared by every command that builds an engine (vLLM's names and defaults)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="model directory or Hugging Face model id (ORG/NAME); default: a tiny random-weight demo "
                            "model built offline")
    group.add_argument("--revision", default=None, help="hub model id: the branch, tag or commit (default: main)")
    group.add_argument("--download-dir", default=None,
                       help="hub model id: the cache directory (default: $HF_HUB_CACHE, else $HF_HOME/hub); "
                            "HF_HUB_OFFLINE=1 reads it without downloading")
    group.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
    group.add_argument("--dtype", default="auto", type=_dtype_name, metavar="{auto,bfloat16,float16,float32}",
                       help="also vLLM's aliases half, bf16, float")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--max-model-len", type=_token_count, default=None, help="tokens; 32k or 1m also read")
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--max-num-queued-reqs", type=int, default=1024)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    group.add_argument("--num-gpu-blocks-override", type=int, default=None)
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                       help="auto: the model dtype; fp8: float8 e4m3 K/V with per-layer, per-head scales")
    group.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    group.add_argument("--data-parallel-size", type=int, default=1,
                       help="engine replicas on disjoint device groups behind one prefix-aware router (serve)")
    group.add_argument("--enable-expert-parallel", action="store_true")
    group.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                       help="several hosts, one engine: process 0's jax.distributed coordinator")
    group.add_argument("--num-processes", type=int, default=None, help="processes (hosts) of one engine")
    group.add_argument("--process-id", type=int, default=None, help="this process's rank; 0 schedules and serves")
    group.add_argument("--chat-template", default=None, help="chat template file or text, overriding the model's")
    group.add_argument("--max-logprobs", type=int, default=20)
    group.add_argument("--generation-config", default="auto",
                       help="sampling defaults for unset request fields: auto = the model's generation_config.json, "
                            "vllm = none (SamplingParams' own), or a directory holding a generation_config.json")
    group.add_argument("--load-format", default="auto", metavar="{auto,safetensors,dummy}",
                       help="dummy: random weights from config.json alone, no checkpoint read (benchmarks; "
                            "quantized as its quantization_config says); the tokenizer still comes from the model "
                            "directory or --tokenizer")
    group.add_argument("--compile-buckets", default="auto", choices=["all", "lazy", "auto"],
                       help="auto: every shape compiled at start-up on a GPU, on first use on the CPU")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                       help="dispatch step N+1 before step N's tokens reach the host (default on)")
    group.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                       help="batch-invariant kernels: a request's output does not depend on its batch (default: on "
                            "for a dense float model on one NVIDIA GPU, about 6%% of throughput; off elsewhere)")
    group.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                       help="launch every step's kernels one by one on an NVIDIA GPU; --no-enforce-eager: every "
                            "step's as XLA's command buffers (CUDA graphs); default: decode steps with command "
                            "buffers, prompt chunks eagerly")
    group.add_argument("--compilation-cache-dir", type=Path, default=None,
                       help="JAX persistent compilation cache (default: $JENGINE_COMPILATION_CACHE_DIR, else "
                            "$JAX_COMPILATION_CACHE_DIR, else ~/.cache/jengine/jax-cache)")
    _add_weight_variant_args(group)
    _add_chat_parsing_args(parser)
    _add_vllm_compat_args(parser)


def _add_weight_variant_args(group: argparse._ArgumentGroup) -> None:
    """Flags that change what the weights compute: quantization, LoRA adapters, speculative decoding."""
    group.add_argument("-q", "--quantization", default=None,
                       help="fp8, compressed-tensors, awq or gptq (vLLM's awq_marlin and gptq_marlin name the same "
                            "checkpoints); unset: the checkpoint's quantization_config. fp8 on a float checkpoint "
                            "quantizes it at load")
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters over the base model")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="PEFT adapter directories loaded at start-up (name=path or a JSON object with name, "
                            "path); requests name them in `model`")
    group.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one step (device slots)")
    group.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters kept in host memory (default: --max-loras)")
    group.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank served")
    group.add_argument("--speculative-config", default=None,
                       help='speculative decoding as JSON, vLLM\'s keys: {"method": "ngram" | "draft_model" | '
                            '"eagle" | "eagle3", "num_speculative_tokens": k, "prompt_lookup_min"/'
                            '"prompt_lookup_max" (ngram), "model": DIR (draft_model, eagle, eagle3), '
                            '"eagle_aux_hidden_state_layer_ids": [i, j, l] (eagle3), "disable_by_batch_size": N}')


def _add_chat_parsing_args(parser: argparse.ArgumentParser) -> None:
    from jengine.config import REASONING_PARSERS, TOOL_CALL_PARSERS

    group = parser.add_argument_group("chat replies (vLLM's flags)")
    group.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                       help="read the <think> span of chat replies into `reasoning` (and `reasoning_content`)")
    group.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                       help="the format tool calls are read in for tool_choice \"auto\"")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="allow tool_choice \"auto\" (the default when a request has tools); needs "
                            "--tool-call-parser")


# vLLM flags accepted so its command lines run unchanged; the config refuses the values that would change something.
_COMPAT_SWITCHES = ("--trust-remote-code", "--disable-log-stats", "--disable-log-requests",
                    "--enable-log-requests", "--calculate-kv-scales")
_COMPAT_VALUES = {"--tokenizer-mode": None,
                  "--task": None, "--swap-space": float, "--uvicorn-log-level": None}


def _add_vllm_compat_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM flags accepted for compatibility (no effect here; values that would "
                                      "change something are refused)")
    for flag in _COMPAT_SWITCHES:
        group.add_argument(flag, action="store_true")
    for flag, kind in _COMPAT_VALUES.items():
        group.add_argument(flag, default=None, type=kind)
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("-pp", "--pipeline-parallel-size", type=int, default=None)


def _dtype_name(text: str) -> str:
    """vLLM's dtype names and aliases → jengine's."""
    names = {"auto": "auto", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16",
             "fp16": "float16", "float32": "float32", "float": "float32", "fp32": "float32"}
    if text.lower() not in names:
        raise argparse.ArgumentTypeError(f"invalid dtype {text!r}; choose from {', '.join(names)}")
    return names[text.lower()]


def _token_count(text: str) -> int:
    """An integer, or with vLLM's suffixes: lower case decimal (25.6k = 25600), upper case binary (32K = 32768)."""
    units = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 4096, 32k, 128K)") from None


def _lora_module_arg(text: str) -> str | dict:
    """vLLM's two spellings of a --lora-modules entry: name=path, or a JSON object."""
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except ValueError:
            raise SystemExit(f"--lora-modules: {text!r} is not valid JSON") from None
    return text


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Flags → `EngineConfig.from_kwargs` keywords (the config refuses features that are not built yet)."""
    from jengine.config import NO_EFFECT

    names = ("tokenizer", "dtype", "seed", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
             "max_num_queued_reqs", "block_size", "gpu_memory_utilization", "num_gpu_blocks_override",
             "enable_prefix_caching", "kv_cache_dtype", "tensor_parallel_size", "data_parallel_size",
             "enable_expert_parallel", "coordinator_address", "num_processes", "process_id", "chat_template",
             "max_logprobs", "generation_config", "load_format", "compile_buckets", "async_scheduling",
             "deterministic", "enforce_eager", "quantization", "lora_modules", "speculative_config",
             "reasoning_parser", "tool_call_parser", "enable_lora", "enable_auto_tool_choice", "max_loras",
             "max_cpu_loras", "max_lora_rank")
    kwargs = {name: getattr(args, name) for name in names}
    kwargs["lora_modules"] = [_lora_module_arg(m) for m in kwargs["lora_modules"] or ()]
    if args.compilation_cache_dir is not None:  # else the config's default
        kwargs["compilation_cache_dir"] = str(args.compilation_cache_dir)
    for name in NO_EFFECT:  # vLLM's flags that change nothing here; the config checks each value
        value = getattr(args, name, None)
        if value is not None and value is not False:
            kwargs[name] = value
    return kwargs


def model_source(args: argparse.Namespace) -> dict[str, str | None]:
    """The flags that say where a hub model id comes from (`LLM(...)` and `resolve_model` keywords)."""
    return {"revision": args.revision, "download_dir": args.download_dir}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jengine", description="LLM inference and serving in JAX.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete prompts and print the text")
    gen.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user message via the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    add_engine_args(gen)
    _add_serve_parser(commands)
    _add_openai_parser(commands)
    from jengine.bench.commands import add_bench_parser

    add_bench_parser(commands)
    from jengine.plan import add_plan_parser

    add_plan_parser(commands)
    for name, what in _NOT_BUILT.items():
        commands.add_parser(name, help=f"{what} (not available in this version)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _NOT_BUILT:
        print(f"jengine {argv[0]}: {_NOT_BUILT[argv[0]]} is not available in this version yet.", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)  # platform probing notes are not for users
    from jengine.errors import JengineError

    command = {"generate": _generate, "serve": _serve, "openai": _openai, "bench": _bench, "plan": _plan}[args.command]
    try:
        return command(args)
    except JengineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # e.g. the port is taken
        print(f"error: {error}", file=sys.stderr)
        return 1


def _generate(args: argparse.Namespace) -> int:
    from jengine import LLM, SamplingParams

    prompts = args.prompt or ["Hello, world!"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, ignore_eos=args.ignore_eos, seed=args.seed)
    with LLM(args.model, **model_source(args), **engine_kwargs(args)) as llm:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
    for output in outputs:
        choice = output.outputs[0]
        print(choice.text)
        logger.info("prompt %d tokens, generated %d tokens (%s)", len(output.prompt_token_ids),
                    len(choice.token_ids), choice.finish_reason)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from jengine.plan import run_plan

    return run_plan(args)


def _bench(args: argparse.Namespace) -> int:
    from jengine.bench.commands import run_bench

    return run_bench(args)


def _add_server_args(parser: argparse.ArgumentParser, *, grpc: bool) -> None:
    """Front-end flags (vLLM's names); the API key may also come from $JENGINE_API_KEY (read in jengine.config)."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="0.0.0.0", help="interface to bind (default: all)")
    group.add_argument("--port", type=int, default=8000, help="OpenAI HTTP port")
    if grpc:
        group.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: no gRPC service)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health, /metrics, /version "
                            "(default: $JENGINE_API_KEY)")
    group.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds SIGTERM waits for in-flight requests before closing connections")
    group.add_argument("--request-timeout", type=float, default=None,
                       help="seconds an HTTP generation request may run before it is aborted and answered 504 "
                            "(a stream that already started ends with an error chunk); default: no limit")
    group.add_argument("--max-header-bytes", type=int, default=64 * 1024,
                       help="largest request header block (request line and fields together); more gets 431")
    for name, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        group.add_argument(f"--allowed-{name}", type=_json_string_list, default=["*"], metavar="JSON",
                           help=f"CORS: the {what} browsers may use, a JSON list (default: [\"*\"], any)")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth)")
    group.add_argument("--metrics-prefix", default="jengine", choices=["jengine", "vllm", "both"],
                       help="/metrics names: jengine:..., vllm:... (a vLLM dashboard works unchanged) or both")


def _json_string_list(text: str) -> list[str]:
    """vLLM's form for the CORS flags: a JSON list of strings (a bare string is taken as a list of one)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = [text]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="serve the OpenAI HTTP API and the gRPC service over one engine")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="model directory or Hugging Face model id (default: a tiny random-weight demo model "
                            "built offline)")
    add_engine_args(serve)
    serve.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                       help="the name clients send as 'model'; several: the first answers, all are accepted")
    _add_server_args(serve, grpc=True)


def _add_openai_parser(commands: argparse._SubParsersAction) -> None:
    openai = commands.add_parser("openai", help="serve the OpenAI HTTP API over a running engine's gRPC service")
    openai.add_argument("--engine", required=True, action="append", metavar="HOST:PORT",
                        help="the gRPC address of `jengine serve`; repeat it to route over several engines (one model)")
    openai.add_argument("--engine-api-key", default=None, help="the API key of that gRPC service, if it has one")
    _add_server_args(openai, grpc=False)


def _server_config(args: argparse.Namespace, grpc_port: int = 0) -> ServerConfig:
    from jengine.config import ServerConfig

    return ServerConfig.from_kwargs(host=args.host, port=args.port, grpc_port=grpc_port, api_key=args.api_key,
                                    drain_timeout=args.drain_timeout, request_timeout=args.request_timeout,
                                    max_header_bytes=args.max_header_bytes,
                                    allowed_origins=tuple(args.allowed_origins),
                                    allowed_methods=tuple(args.allowed_methods),
                                    allowed_headers=tuple(args.allowed_headers),
                                    allow_credentials=args.allow_credentials,
                                    metrics_prefix=args.metrics_prefix,
                                    log_requests=not getattr(args, "disable_log_requests", False),
                                    log_stats_interval=0.0 if getattr(args, "disable_log_stats", False) else None)


def _serve_model(args: argparse.Namespace) -> tuple[str, str | list[str] | None]:
    """(model directory, served name): MODEL or --model (a directory or a hub id, served under that id), else the
    demo model under a name that says what it is."""
    from jengine.errors import ConfigError
    from jengine.models.hub import resolve_model

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ConfigError("give the model once: either as MODEL or as --model")
    resolved = resolve_model(args.model_tag or args.model, **model_source(args))
    names = args.served_model_name
    served = names[0] if names and len(names) == 1 else names  # several: the first answers, all are accepted
    if resolved.path == Path(resolved.name).expanduser():
        return str(resolved.path), served  # a directory: named by its path, as before
    return str(resolved.path), served or resolved.name


def _serve(args: argparse.Namespace) -> int:
    """`jengine serve`: build the engine (minutes for a large model), then serve HTTP + gRPC until SIGTERM."""
    from jengine.config import EngineConfig
    from jengine.models.hub import resolve_tokenizer
    from server.app import run_server

    server_config = _server_config(args, args.grpc_port)
    model, served_name = _serve_model(args)
    kwargs = engine_kwargs(args) | {"tokenizer": resolve_tokenizer(args.tokenizer, download_dir=args.download_dir)}
    engine_config = EngineConfig.from_kwargs(model, served_model_name=served_name, **kwargs)
    if engine_config.parallel.num_processes > 1 and engine_config.parallel.process_id:
        from jengine.worker import serve_worker

        return serve_worker(engine_config)  # no API here: process 0 serves, this one runs the same steps
    engine = _serving_engine(engine_config)
    return run_server(lambda: engine, server_config, with_grpc=True)


def _serving_engine(config: EngineConfig) -> EngineClient:
    """One in-process engine, or `data_parallel_size` of them behind the prefix-aware router."""
    from jengine.clients.async_engine import AsyncEngine
    from jengine.clients.router import Router

    if config.parallel.data_parallel_size > 1:
        return Router.from_config(config)
    return AsyncEngine.from_config(config)


def _openai(args: argparse.Namespace) -> int:
    """`jengine openai --engine HOST:PORT [--engine HOST:PORT ...]`: the HTTP shim alone, over a gRPC-backed
    EngineClient, or over the prefix-aware router when several engines are given."""
    from jengine.errors import ConfigError
    from server.app import run_server

    for address in args.engine:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--engine must be HOST:PORT, got {address!r}")
    if len(set(args.engine)) != len(args.engine):
        raise ConfigError("each --engine address may be given once")

    def make_client() -> EngineClient:  # called inside the event loop: the gRPC channels bind to it
        try:
            from server.grpc_client import GrpcEngineClient
        except ImportError as exc:
            raise ConfigError(f"the gRPC engine client is not available in this build ({exc})") from None
        from jengine.clients.router import Router

        clients = [GrpcEngineClient(address, api_key=args.engine_api_key) for address in args.engine]
        if len(clients) == 1:
            return clients[0]
        try:
            return Router(clients)
        except BaseException:
            for client in clients:
                client.shutdown()
            raise

    return run_server(make_client, _server_config(args), with_grpc=False)
