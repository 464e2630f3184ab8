"""A whole MoE model on the GPU with the grouped-matmul kernels: greedy parity, decode steps ÷ the bytes floor, and
the engine at its defaults serving the sharegpt-like mixed set. Random weights made on the device (`load_format=
"dummy"`), shapes from `scripts/moe_shapes.py`.

    PYTHONPATH=. python scripts/bench_moe.py --out DIR --git-sha SHA --part parity decode  # Qwen3-30B-A3B, 48 layers
    PYTHONPATH=. python scripts/bench_moe.py --out DIR --git-sha SHA --part mixed-qwen mixed-mixtral
    PYTHONPATH=. python scripts/bench_moe.py --out DIR --git-sha SHA --part decode --quant bf16 awq fp8-block

Decode: 256-token prompts at batch 1, 16, 64, 256; the step time is the difference of a 65-token and a 1-token
generation ÷ 64 (each timed after a warm-up of the same shapes). Its floor: the bytes of every layer's attention
projections, norms and router, the distinct experts the step reads (E·(1 − (1 − k/E)^batch) per layer for uniform
routing), the LM head, the embedding rows and the KV read, ÷ the copy bandwidth measured in the same call.
Writes into `DIR/<date>-moe.json` (merged with `scripts/bench_moe_kernels.py`'s figures).

`--quant` adds the same model quantized, dummy weights from a `quantization_config` in its config.json: `awq`
(4-bit, group 128: every projection and expert packed) and `fp8-block` (float8, 128 × 128 block scales, as
Qwen3-30B-A3B-FP8); their floor counts those bytes (scales and zero points included). Keys
`moe_<quant>_decode_b<N>_ms`, `..._vs_floor`, and `..._vs_bf16` (bf16 step ÷ its step) where bf16 ran in the same call.
`--xla-router-too` runs the bf16 model again with the router's softmax/top-k as XLA's ops instead of the fused kernel
(`moe_xla_router_decode_*`), the A/B of `PallasExperts.fused_router_max_tokens` in one call; `--decode-tiles-too
k128 stages3` likewise with the decode-sized expert tiles changed (`moe_tiles_<NAME>_decode_*`), `--listed-too`
with the fused router listing the chosen experts (`PallasExperts.list_chosen`, `moe_listed_decode_*`), and
`--xla-combine-too` with XLA's combine and residual add after the experts (`moe_xla_combine_decode_*`), and
`--merged-attention-too` with the attention launches a decode step dropped in b24ae54 and e37fa30 put back
(`moe_merged_attention_decode_*`). Each variant runs with JAX's caches cleared (`retraced`).

`--part prefill`: a 4,096-token prompt's first token (one chunk of the engine's 4,096-token budget; median of 5 after
a warm-up), `moe_prefill_4k_ms`, and the same for each variant asked for; `--mosaic-experts-too` runs the variant
whose steps of at least `--mosaic-min-tokens` tokens take the Mosaic GPU grouped matmuls
(`jengine.attention.pallas.MOSAIC_EXPERTS_MIN_TOKENS`; keys `moe_mosaic_experts_*`, ratio
`moe_prefill_4k_mosaic_vs_triton`, the default's time ÷ the variant's); `--triton-experts-too` the variant with the
Triton kernels at every size (keys `moe_triton_experts_*`; the ratio is then its time ÷ the default's, whose
4,096-token steps take the Mosaic kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench_common import (copy_bandwidth, jax_device_name, log, merge_records, read_record,  # noqa: E402
                              result_record, versions, write_record)
from moe_shapes import write_shape  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 256, 64
BATCHES = (1, 16, 64, 256)


def greedy_tokens(model_dir: Path, **kw) -> list[list[int]]:
    from jengine import LLM, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, n).tolist()} for n in (7, 40, 300)]
    with LLM(str(model_dir), load_format="dummy", dtype="float32", max_model_len=512, **kw) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, min_tokens=24), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def parity(tmp: Path) -> dict:
    """float32 reduced Qwen3-MoE: kernels (default backend) vs the reference backend (ragged_dot)."""
    small = write_shape("qwen3-30b-a3b", tmp / "small", num_layers=3, hidden_size=256, moe_intermediate_size=128,
                        num_experts=16, num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, torch_dtype="float32")
    ours, ref = greedy_tokens(small), greedy_tokens(small, attention_backend="reference")
    same = sum(a == b for a, b in zip(ours, ref))
    log(f"parity: {same}/{len(ref)} greedy outputs identical")
    assert same == len(ref), (ours, ref)
    return {"greedy_identical_fraction": same / len(ref)}


QUANT_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "weight_block_size": [128, 128]},
}
# bytes a quantized projection weight takes per element: 4 bits + float16 scale and zero per 128 rows; 1 byte + a
# float32 scale per 128 × 128 block
PROJECTION_BYTES = {"bf16": 2.0, "awq": 0.5 + 4 / 128, "fp8-block": 1 + 4 / (128 * 128)}


def floor_bytes(config: dict, batch: int, context: int, quant: str = "bf16") -> int:
    d, layers, e, k = (config[x] for x in ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok"))
    heads, kv, hd, inter = (config[x] for x in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                "moe_intermediate_size"))
    projections = 2 * d * heads * hd + 2 * d * kv * hd  # q and o, k and v
    floats = 2 * d + 2 * hd + d * e  # norms, router
    distinct = e * (1 - (1 - k / e) ** batch)
    experts = distinct * 3 * d * inter
    kv_read = batch * context * layers * 2 * kv * hd
    float_elements = layers * floats + config["vocab_size"] * d + batch * d + kv_read
    return int(float_elements * 2 + layers * (projections + experts) * PROJECTION_BYTES[quant])


def xla_router():
    """The engine with the router's softmax/top-k always as XLA's ops (never the fused kernel): an A/B
    of `PallasExperts.fused_router_max_tokens` in the same call."""
    from unittest import mock

    from jengine.layers.mlp import PallasExperts

    return mock.patch.object(PallasExperts, "fuses_top_k", lambda self, router, tokens: False)


def decode_tiles(**changes):
    """The engine with its decode-sized expert tiles (up to 32 rows) changed by `changes` (`TileConfig` fields):
    an A/B of `pallas_kernels.grouped_matmul.moe.tile_configs` in the same call."""
    import dataclasses
    from unittest import mock

    from pallas_kernels.grouped_matmul import moe

    default = moe.tile_configs

    def changed(num_pairs: int, num_experts: int, itemsize: int = 2):
        configs = default(num_pairs, num_experts, itemsize)
        if configs[0].block_rows > 32:
            return configs
        return tuple(dataclasses.replace(c, **changes) for c in configs)

    return mock.patch.object(moe, "tile_configs", changed)


def listed_router():
    """The engine with the fused router listing the chosen experts for the by-token launches
    (`PallasExperts.list_chosen`): its A/B in the same call."""
    from unittest import mock

    from jengine.attention.pallas import PallasGpuBackend
    from jengine.layers.mlp import PallasExperts

    listing = property(lambda self: PallasExperts(interpret=self.interpret, mesh=self.mesh, list_chosen=True))
    return mock.patch.object(PallasGpuBackend, "experts", listing)


def xla_combine():
    """The engine with the combine as it was before 2595211: the sorted layout's as XLA's gather and sum
    (`routing.combine`), the residual added by XLA after either layout's combine: the A/B of `combine_slots` and of
    the fused residual add in the same call."""
    from unittest import mock

    from pallas_kernels.grouped_matmul import moe
    from pallas_kernels.grouped_matmul.combine import combine_pairs
    from pallas_kernels.grouped_matmul.routing import combine

    def slots(y, pair_slot, interpret=False, residual=None):
        out = combine(y, pair_slot)
        return out if residual is None else residual + out

    def pairs(y, experts, num_experts, interpret=False, residual=None):
        out = combine_pairs(y, experts, num_experts, interpret=interpret)
        return out if residual is None else residual + out

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(moe, "combine_slots", slots))
    stack.enter_context(mock.patch.object(moe, "combine_pairs", pairs))
    return stack


def merged_attention():
    """The engine's attention as before b24ae54: every decode step merges its splits (even of one split), and a
    decode-only step's launches update a zero-filled output in place: the A/B of the launches that dropped."""
    from unittest import mock

    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import kernel

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(kernel, "merge_free", lambda positions, split: False))
    stack.enter_context(mock.patch.object(kernel, "decode_only_start", jnp.zeros_like))
    return stack


def mosaic_experts(min_tokens: int = 1024):
    """The engine with MoE steps of at least `min_tokens` tokens through the Mosaic GPU grouped matmuls: the A/B of
    `jengine.attention.pallas.MOSAIC_EXPERTS_MIN_TOKENS` in the same call."""
    from unittest import mock

    from jengine.attention import pallas

    return mock.patch.object(pallas, "MOSAIC_EXPERTS_MIN_TOKENS", min_tokens)


def triton_experts():
    """The engine with the Triton grouped matmuls at every step size: the other side of the default's Mosaic ones."""
    return mosaic_experts(0)


DECODE_TILES = {"k128": {"block_k": 128}, "stages3": {"num_stages": 3}, "n64": {"block_n": 64},
                "n128": {"block_n": 128}}


# name: the context that changes the engine for that A/B (`--<name>-too`; `probe_layer_loop_gpu --engine-variant`)
ENGINE_VARIANTS: dict[str, Callable[[], Any]] = {"xla_router": xla_router, "listed": listed_router,
                                                 "xla_combine": xla_combine, "merged_attention": merged_attention,
                                                 "mosaic_experts": mosaic_experts, "triton_experts": triton_experts}


def engine_variants(args: argparse.Namespace) -> list[tuple[str, Callable[[], Any]]]:
    """(key suffix, context that changes the engine) of each A/B the flags ask for, run on bf16 after the default."""
    variants = [(f"_{name}", context) for name, context in ENGINE_VARIANTS.items() if getattr(args, f"{name}_too")]
    variants = [(name, functools.partial(mosaic_experts, args.mosaic_min_tokens) if name == "_mosaic_experts"
                 else context) for name, context in variants]
    return variants + [(f"_tiles_{name}", functools.partial(decode_tiles, **DECODE_TILES[name]))
                       for name in args.decode_tiles_too]


@contextlib.contextmanager
def retraced(context):
    """`context` with JAX's in-memory caches cleared on the way in and out and the engine's saved step programs
    off (`runner/program_store.py`): the patches change what the layer functions trace, and those caches, keyed on
    static arguments that do not see the patches, would otherwise hand the variant the default's compiled step (an
    A/B of two identical programs)."""
    import os

    import jax

    from jengine.runner.program_store import STORE_SWITCH

    jax.clear_caches()
    saved, os.environ[STORE_SWITCH] = os.environ.get(STORE_SWITCH), "off"
    try:
        with context:
            yield
    finally:
        jax.clear_caches()
        if saved is None:
            os.environ.pop(STORE_SWITCH)
        else:
            os.environ[STORE_SWITCH] = saved


def decode(tmp: Path, copy_rate: float, batches: list[int], save, quant: str = "bf16", layers: int | None = None,
           variant: tuple[str, Callable[[], Any]] = ("", contextlib.nullcontext)) -> tuple[dict, dict]:
    """The decode steps of `batches` (keys `moe[_<quant>]<suffix>_decode_b<N>_*`) with the engine as `variant`'s
    context leaves it."""
    suffix, context = variant
    with retraced(context()):
        return _decode(tmp, copy_rate, batches, save, quant, layers, suffix)


def _decode(tmp: Path, copy_rate: float, batches: list[int], save, quant: str, layers: int | None,
            suffix: str) -> tuple[dict, dict]:
    from jengine import LLM, SamplingParams

    extra = {} if quant == "bf16" else {"quantization_config": QUANT_CONFIGS[quant]}
    model_dir = write_shape("qwen3-30b-a3b", tmp / f"qwen3-{quant}{suffix}", num_layers=layers, **extra)
    config = json.loads((model_dir / "config.json").read_text())
    prefix = ("moe" if quant == "bf16" else f"moe_{quant.replace('-', '_')}") + suffix
    metrics, ratios = {}, {}
    rng = np.random.default_rng(1)
    # no prefix caching: the timed repeat of a warm-up would hit the cache, change the prefill's shape and compile;
    # lazy compilation: the warm-ups compile the shapes timed, where `auto` would compile every bucket of 48 layers
    with LLM(str(model_dir), load_format="dummy", max_model_len=1024, max_num_seqs=max(batches),
             enable_prefix_caching=False, compile_buckets="lazy") as llm:
        for batch in batches:
            prompts = [{"prompt_token_ids": rng.integers(3, 500, PROMPT_LEN).tolist()} for _ in range(batch)]

            def run(n: int) -> float:
                params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
                llm.generate(prompts, params, use_tqdm=False)  # warm-up: the same shapes compiled
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                return time.perf_counter() - start

            step = (run(NEW_TOKENS + 1) - run(1)) / NEW_TOKENS
            floor = floor_bytes(config, batch, PROMPT_LEN + NEW_TOKENS // 2, quant) / copy_rate
            metrics[f"{prefix}_decode_b{batch}_ms"] = step * 1e3
            metrics[f"{prefix}_decode_b{batch}_floor_ms"] = floor * 1e3
            ratios[f"{prefix}_decode_b{batch}_vs_floor"] = step / floor
            log(f"decode {quant}{suffix} b{batch}: {step * 1e3:.3f} ms/step, floor {floor * 1e3:.3f} ms → "
                f"{step / floor:.2f}×")
            save(metrics, ratios)  # a long call keeps what it measured
    return metrics, ratios


PREFILL_TOKENS = 4096


def prefill(tmp: Path, layers: int | None, variant: tuple[str, Callable[[], Any]] = ("", contextlib.nullcontext)
            ) -> dict:
    """A `PREFILL_TOKENS`-token prompt's time to its first token in one chunk (`moe<suffix>_prefill_4k_ms`), the
    engine as `variant`'s context leaves it."""
    from jengine import LLM, SamplingParams

    suffix, context = variant
    model_dir = write_shape("qwen3-30b-a3b", tmp / f"qwen3-prefill{suffix}", num_layers=layers)
    rng = np.random.default_rng(2)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    with retraced(context()), LLM(str(model_dir), load_format="dummy", max_model_len=PREFILL_TOKENS + 64,
                                   max_num_batched_tokens=PREFILL_TOKENS, enable_prefix_caching=False,
                                   compile_buckets="lazy") as llm:
        for i in range(6):  # the first compiles the shape
            prompt = {"prompt_token_ids": rng.integers(3, 500, PREFILL_TOKENS).tolist()}
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            if i:
                times.append(time.perf_counter() - start)
    ms = float(np.median(times)) * 1e3
    log(f"prefill{suffix} {PREFILL_TOKENS} tokens: {ms:.2f} ms")
    return {f"moe{suffix}_prefill_4k_ms": ms}


def mixed(tmp: Path, shape: str) -> float:
    """`jengine bench throughput` at its defaults on the sharegpt-like set, 1,000 requests, in its own process."""
    model_dir = write_shape(shape, tmp / shape)
    out = tmp / f"{shape}.json"
    cmd = [sys.executable, "-m", "jengine", "bench", "throughput", "--model", str(model_dir), "--load-format",
           "dummy", "--dataset-name", "sharegpt-like", "--num-prompts", "1000", "--output-json", str(out)]
    subprocess.run(cmd, check=True)
    tps = json.loads(out.read_text())["output_throughput"]
    log(f"mixed {shape}: {tps:.0f} output tok/s")
    return tps


def save(out: str, git_sha: str, metrics: dict, ratios: dict, extra_versions: tuple[str, ...] = ()) -> None:
    """This call's figures into `out/<date>-moe.json`, merged with what earlier calls (either MoE script) wrote."""
    record = result_record("moe", git_sha, jax_device_name(), versions(extra_versions),
                           " ".join(["python", *sys.argv]), metrics, ratios)
    path = Path(out) / f"{datetime.date.today().isoformat()}-moe.json"
    if path.exists():
        record = merge_records(read_record(path), record)
    write_record(path, record)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--part", nargs="+", required=True,
                    choices=("parity", "decode", "prefill", "mixed-qwen", "mixed-mixtral"))
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--git-sha", default="unknown", help="the commit measured (the GPU machine has no .git)")
    ap.add_argument("--quant", nargs="+", choices=("bf16", *QUANT_CONFIGS), default=["bf16"],
                    help="decode: the model in these weight formats, one after the other (see the docstring)")
    ap.add_argument("--layers", type=int, default=None, help="decode: fewer layers than the model's 48 (a smaller "
                    "card); the floor counts the same layers")
    ap.add_argument("--xla-router-too", action="store_true", help="decode: bf16 again with the router as XLA's ops "
                    "(keys moe_xla_router_decode_*): the fused router's A/B in one call")
    ap.add_argument("--listed-too", action="store_true", help="decode: bf16 again with the fused router listing the "
                    "chosen experts (PallasExperts.list_chosen; keys moe_listed_decode_*)")
    ap.add_argument("--xla-combine-too", action="store_true", help="decode: bf16 again with XLA's combine and "
                    "residual add after the experts (keys moe_xla_combine_decode_*)")
    ap.add_argument("--merged-attention-too", action="store_true", help="decode: bf16 again with the attention's "
                    "merge always run and decode-only outputs zero-filled first (keys moe_merged_attention_decode_*)")
    ap.add_argument("--mosaic-experts-too", action="store_true", help="decode, prefill: again with MoE steps of at "
                    "least --mosaic-min-tokens through the Mosaic GPU grouped matmuls (keys moe_mosaic_experts_*)")
    ap.add_argument("--mosaic-min-tokens", type=int, default=1024)
    ap.add_argument("--triton-experts-too", action="store_true", help="decode, prefill: again with the Triton "
                    "grouped matmuls at every step size (keys moe_triton_experts_*)")
    ap.add_argument("--decode-tiles-too", nargs="+", choices=tuple(DECODE_TILES), default=[],
                    help="decode: bf16 again with the decode-sized expert tiles changed "
                    "(keys moe_tiles_<NAME>_decode_*)")
    args = ap.parse_args()
    metrics: dict = {}
    ratios: dict = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if "parity" in args.part:
            ratios["moe_gpu_greedy_identical_fraction"] = parity(tmp)["greedy_identical_fraction"]
            save(args.out, args.git_sha, metrics, ratios)
        if "decode" in args.part:
            _, copy_rate = copy_bandwidth()
            metrics["copy_bandwidth_gbs"] = copy_rate / 1e9
            for quant in args.quant:
                m, r = decode(tmp, copy_rate, args.batches,
                              lambda m, r: save(args.out, args.git_sha, metrics | m, ratios | r), quant, args.layers)
                metrics, ratios = metrics | m, ratios | r
            for variant in engine_variants(args):
                m, r = decode(tmp, copy_rate, args.batches,
                              lambda m, r: save(args.out, args.git_sha, metrics | m, ratios | r), "bf16", args.layers,
                              variant)
                metrics, ratios = metrics | m, ratios | r
            for quant in args.quant:  # both sides measured in this call
                for batch in args.batches:
                    key = f"moe_{quant.replace('-', '_')}_decode_b{batch}"
                    if quant != "bf16" and "bf16" in args.quant:
                        ratios[f"{key}_vs_bf16"] = metrics[f"moe_decode_b{batch}_ms"] / metrics[f"{key}_ms"]
            save(args.out, args.git_sha, metrics, ratios)
        if "prefill" in args.part:
            for variant in [("", contextlib.nullcontext)] + engine_variants(args):
                metrics |= prefill(tmp, args.layers, variant)
                save(args.out, args.git_sha, metrics, ratios)
            if "moe_triton_experts_prefill_4k_ms" in metrics:  # the default takes the Mosaic kernels at 4,096
                ratios["moe_prefill_4k_mosaic_vs_triton"] = (metrics["moe_triton_experts_prefill_4k_ms"]
                                                             / metrics["moe_prefill_4k_ms"])
            elif "moe_mosaic_experts_prefill_4k_ms" in metrics:
                ratios["moe_prefill_4k_mosaic_vs_triton"] = (metrics["moe_prefill_4k_ms"]
                                                             / metrics["moe_mosaic_experts_prefill_4k_ms"])
            save(args.out, args.git_sha, metrics, ratios)
        for part, shape, key in (("mixed-qwen", "qwen3-30b-a3b", "moe_mixed_tokens_per_s"),
                                 ("mixed-mixtral", "mixtral-8x7b", "mixtral_mixed_tokens_per_s")):
            if part in args.part:
                metrics[key] = mixed(tmp, shape)
                save(args.out, args.git_sha, metrics, ratios)


if __name__ == "__main__":
    main()
