"""`jengine plan MODEL`: will it fit? Weights, KV cache and the activation reserve per device, from config.json alone.

The figures come from the engine's own definitions: the KV block layout (`kv_storage.bytes_per_block`), the
activation reserve (`kv_storage.activation_reserve`) and the rule that turns a device's memory into KV blocks
(`memory_budget.kv_blocks_that_fit`, the one function the engine's planner also calls). Weights are counted from the
config (the engine measures them once placed): every linear layer split over the tensor-parallel devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from jengine.models.spec import ModelSpec

GIB = 1 << 30
TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
# Bytes per weight of the linear layers by quantization scheme (int4 schemes packed as `layers/quant4.py` keeps
# them: half a byte, plus float16 scales and zero points per 128-row group).
WEIGHT_BYTES = {"fp8": 1.0, "awq": 0.5 + 4 / 128, "gptq": 0.5 + 4 / 128}


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    tensor_parallel_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    kv_cache_dtype: str  # auto | fp8 | fp8_e4m3
    quantization: str | None  # None | fp8 | awq | gptq
    weight_bytes: float | None = None  # bytes per linear weight read from the config's quantization_config


@dataclasses.dataclass(frozen=True)
class DeviceFigures:
    """One device's share, in bytes, for a given tensor-parallel size and batch."""

    weights: int
    kv_cache: int  # max_num_seqs requests of max_model_len tokens
    reserve: int  # activations of the largest step
    available: int  # utilization × device memory
    kv_blocks_that_fit: int
    kv_blocks_wanted: int

    @property
    def fits(self) -> bool:
        return self.kv_blocks_that_fit >= self.kv_blocks_wanted


def parameter_counts(spec: ModelSpec) -> tuple[int, int]:
    """(weights of the linear layers, of the embeddings and LM head): what quantization changes and what it keeps."""
    d, hd = spec.hidden_size, spec.head_dim
    attention = d * hd * (2 * spec.num_heads + 2 * spec.num_kv_heads)  # q, o and k, v
    linear = 0
    for kind in spec.mlp_kinds:
        if kind == "moe" and spec.moe is not None:
            mlp = spec.moe.num_experts * 3 * d * spec.moe.intermediate_size + d * spec.moe.num_experts
            if spec.moe.shared_intermediate_size:  # Qwen2-MoE's shared expert and its gate
                mlp += 3 * d * spec.moe.shared_intermediate_size + d
        else:
            mlp = 3 * d * spec.intermediate_size
        linear += attention + mlp + 2 * d + (2 * hd if spec.qk_norm else 0)
    embeddings = spec.vocab_size * d * (1 if spec.tie_word_embeddings else 2) + d
    return linear, embeddings


def quantized_workspace(spec: ModelSpec, linear_bytes: float, dtype_bytes: int) -> int:
    """The engine's reserve for quantized weights (`layers/quant.workspace_bytes`) from the spec: the largest copy
    a step makes of one weight: two dequantized 8-bit expert stacks at once (4-bit ones are read packed on the GPU),
    else the largest projection dequantized. 0 for float weights."""
    if linear_bytes >= dtype_bytes:
        return 0
    d, hd = spec.hidden_size, spec.head_dim
    dense = max(d * hd * (spec.num_heads + 2 * spec.num_kv_heads), 2 * d * spec.intermediate_size)
    moe = spec.moe
    if moe is not None and linear_bytes >= 1.0:
        return max(dense, 2 * moe.num_experts * d * moe.intermediate_size) * dtype_bytes
    return dense * dtype_bytes


def config_weight_bytes(hf_config: dict) -> tuple[float, str] | None:
    """(bytes per linear weight, a label) of a checkpoint's `quantization_config` as jengine holds its weights:
    4-bit values with float16 scales and zero points per group, 8-bit ones with their scales; None for a float
    checkpoint or a method the loader refuses."""
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config") or {}
    method = qc.get("quant_method")
    if method in ("fp8", "modelopt"):
        return 1.0, method
    if method in ("awq", "gptq"):
        bits, group = int(qc.get("bits", qc.get("w_bit", 4))), int(qc.get("group_size", qc.get("q_group_size", 128)))
    elif method == "compressed-tensors":
        weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
        if not weights:
            return None
        bits, group = int(weights[0].get("num_bits", 8)), int(weights[0].get("group_size") or -1)
    else:
        return None
    per_group = 4 / group if group > 0 else 0.0  # two float16s (or one float32) per group of inputs
    return bits / 8 + per_group, f"{method} {bits}-bit" + (f", group {group}" if group > 0 else "")


def device_figures(spec: ModelSpec, request: PlanRequest, tp: int, max_num_seqs: int) -> DeviceFigures:
    """The per-device figures at `tp` devices and `max_num_seqs` requests (the engine's arithmetic throughout)."""
    from jengine.attention.kv_cache import cache_dtype
    from jengine.config import SchedulerConfig
    from jengine.models.loader import resolve_dtype
    from jengine.runner.kv_storage import activation_reserve, bytes_per_block
    from jengine.runner.memory_budget import kv_blocks_that_fit

    dtype = resolve_dtype("auto", spec.checkpoint_dtype, platform="gpu")
    repeat = 1 if spec.num_kv_heads % tp == 0 else max(1, tp // spec.num_kv_heads)  # as parallel.sharding does
    kv_spec = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads * repeat)
    block_bytes = bytes_per_block(kv_spec, request.block_size, cache_dtype(request.kv_cache_dtype, dtype)) // tp
    linear, embeddings = parameter_counts(spec)
    linear_bytes = WEIGHT_BYTES.get(request.quantization or "", request.weight_bytes or dtype.itemsize)
    weights = math.ceil((linear * linear_bytes + embeddings * dtype.itemsize) / tp)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=request.max_num_batched_tokens,
                            max_model_len=request.max_model_len)
    reserve = activation_reserve(spec, sched) + quantized_workspace(spec, linear_bytes, dtype.itemsize) // tp
    wanted = max_num_seqs * -(-request.max_model_len // request.block_size)
    fit = kv_blocks_that_fit(request.gpu_memory_bytes, request.gpu_memory_utilization, weights, reserve, block_bytes)
    return DeviceFigures(weights, wanted * block_bytes, reserve,
                         int(request.gpu_memory_bytes * request.gpu_memory_utilization), fit, wanted)


def what_would_fit(spec: ModelSpec, request: PlanRequest) -> tuple[int | None, int]:
    """(the least tensor-parallel size above the asked one that fits, None if none does; the most max_num_seqs that
    fits at the asked size, 0 if not even one)."""
    tp = request.tensor_parallel_size
    larger = [k for k in TP_CANDIDATES if k > tp and spec.num_heads % k == 0]
    least_tp = next((k for k in larger if device_figures(spec, request, k, request.max_num_seqs).fits), None)
    low, high = 0, request.max_num_seqs  # the largest batch that fits: fitting only gets easier with fewer requests
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if device_figures(spec, request, tp, middle).fits else (low, middle - 1)
    return least_tp, low


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    from jengine.cli import _token_count  # the engine flags' reading of 8192, 8k, 32K

    plan = commands.add_parser("plan", help="weights + KV cache + activations per device from config.json: does it "
                                            "fit?")
    plan.add_argument("model", metavar="MODEL", help="model directory (config.json is enough) or hub model id")
    plan.add_argument("--revision", default=None)
    plan.add_argument("--download-dir", default=None)
    plan.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    plan.add_argument("--max-model-len", type=_token_count, default=None, help="default: the model's context")
    plan.add_argument("--max-num-seqs", type=int, default=256)
    plan.add_argument("--max-num-batched-tokens", type=int, default=2048)
    plan.add_argument("--block-size", type=int, default=16)
    plan.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    plan.add_argument("--quantization", default=None, choices=sorted(WEIGHT_BYTES),
                      help="weight format of the linear layers (embeddings keep the model dtype); default: the "
                           "config's quantization_config, else the model dtype")
    plan.add_argument("--gpu-memory", type=float, default=80.0, metavar="GiB", help="memory of one GPU (80: H100)")
    plan.add_argument("--gpu-memory-utilization", type=float, default=0.92)


def run_plan(args: argparse.Namespace) -> int:
    """Prints the per-device figures and the verdict; exit status 0 when it fits, 1 when it does not."""
    from jengine.factory import model_context_limit
    from jengine.models.formats import read_model_config
    from jengine.models.hub import resolve_model
    from jengine.models.loader import load_spec

    model = resolve_model(args.model, revision=args.revision, download_dir=args.download_dir, config_only=True)
    spec = load_spec(model.path)  # config.json (or a GGUF file's metadata) only
    stored = None if args.quantization else config_weight_bytes(read_model_config(model.path))
    request = PlanRequest(args.tensor_parallel_size, args.max_model_len or model_context_limit(spec)[0],
                          args.max_num_seqs, args.max_num_batched_tokens, args.block_size,
                          int(args.gpu_memory * GIB), args.gpu_memory_utilization, args.kv_cache_dtype,
                          args.quantization, stored[0] if stored else None)
    if stored:
        print(f"weights as its quantization_config stores them: {stored[1]} ({stored[0]:.3g} bytes a weight)")
    figures = device_figures(spec, request, request.tensor_parallel_size, request.max_num_seqs)
    for line in plan_report(model.name, spec, request, figures):
        print(line)
    return 0 if figures.fits else 1


def plan_report(name: str, spec: ModelSpec, request: PlanRequest, figures: DeviceFigures) -> list[str]:
    linear, embeddings = parameter_counts(spec)
    total = figures.weights + figures.kv_cache + figures.reserve
    lines = [
        f"{name}: {spec.architecture}, {(linear + embeddings) / 1e9:.1f} B parameters, {spec.num_layers} layers, "
        f"{spec.num_kv_heads} KV heads of {spec.head_dim}",
        f"per device (tensor parallel {request.tensor_parallel_size}, {request.max_num_seqs} × "
        f"{request.max_model_len} tokens of KV cache):",
        f"  weights           {figures.weights / GIB:9.2f} GiB",
        f"  KV cache          {figures.kv_cache / GIB:9.2f} GiB",
        f"  activations       {figures.reserve / GIB:9.2f} GiB",
        f"  total             {total / GIB:9.2f} GiB of {figures.available / GIB:.2f} GiB available "
        f"({request.gpu_memory_utilization:g} × {request.gpu_memory_bytes / GIB:g} GiB)",
    ]
    if figures.fits:
        return lines + [f"fits: room for {figures.kv_blocks_that_fit * request.block_size} KV tokens per device"]
    least_tp, most_seqs = what_would_fit(spec, request)
    options = ([f"TP ≥ {least_tp}"] if least_tp else []) + ([f"max-num-seqs ≤ {most_seqs}"] if most_seqs else [])
    advice = " or ".join(options) if options else "a larger GPU"
    return lines + [f"does not fit: needs {advice}"]
