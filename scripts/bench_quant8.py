"""GPU check-and-bench of 8-bit weights: FP8 (per channel, 128 × 128 blocks) and INT8 W8A16 against bfloat16, on a
Llama-3.1-8B-shaped model with random weights quantized here.

Each variant runs the engine's model step (`models/decoder.forward` + the logits rows, the platform's attention
backend, the KV cache donated step to step): decode at batch 1 over a `--context`-token cache and one
`--prefill`-token chunk. Correctness first: each variant's projections on the step's shapes against the CPU
reference math (dequantize, then a float32 matmul) and its decode logits against the reference-math step; the
compiled decode and prefill programs are searched for cuBLASLt's FP8 GEMM (`__cublas$lt$matmul$f8`). Then every
ratio's two sides are timed in this one call. The floor of a decode step is the bytes it must read (the weights as
stored, scales included, the bfloat16 LM head, the K/V of the context) ÷ the measured device-to-device copy rate.

    PYTHONPATH=. python scripts/bench_quant8.py --out $OUT/quant8.json --git-sha <sha>
    PYTHONPATH=. python scripts/bench_quant8.py --tiny --out /tmp/quant8.json     # shape check on the CPU

All variants in one call may not fit a 10-minute device call; split it by ratio (each call holds both sides of its
ratios) and merge the files: `--variants bf16,fp8_channel,int8_w8a16` (the decode/prefill ratios against bfloat16
and the floor), `--variants fp8_channel,fp8_block` (block vs channel), `--variants
bf16,fp8_channel_pallas,int8_w8a16_pallas,fp8_w8a16 --only decode` (the Pallas decode kernel and float8 weights with
bf16 activations, extra keys), then `--merge A.json B.json C.json --out FILE`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_bench_common as common  # noqa: E402
from gpu_bench_common import log  # noqa: E402

LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                   head_dim=128, num_hidden_layers=32, vocab_size=128256)
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            num_hidden_layers=2, vocab_size=512)
BLOCK = 16
# name → (weight type, activations, block_k, block_n, activation group[, implementation]); None: bfloat16
VARIANTS: dict[str, tuple | None] = {
    "bf16": None,
    "fp8_channel": ("fp8", "fp8", 0, 1, 0),
    "fp8_block": ("fp8", "fp8", 128, 128, 128),
    "int8_w8a16": ("int8", None, 0, 1, 0),
    "int8_w8a8": ("int8", "int8", 0, 1, 0),
    # float8 weights with bfloat16 activations: no activation quantization in the step (a candidate for decode)
    "fp8_w8a16": ("fp8", None, 0, 1, 0),
    # decode through the Pallas kernel (pallas_kernels/quant_matmul), prefill as above
    "fp8_channel_pallas": ("fp8", "fp8", 0, 1, 0, "pallas"),
    "int8_w8a16_pallas": ("int8", None, 0, 1, 0, "pallas"),
    # decode through the Mosaic GPU weight-only kernel (pallas_kernels/weight_only), prefill as above
    "int8_w8a16_mosaic": ("int8", None, 0, 1, 0, "mosaic"),
    "fp8_channel_mosaic": ("fp8", "fp8", 0, 1, 0, "mosaic"),
}
# Max rel. error vs the `emulated` math (the same 8-bit rounding of the activations, float32 accumulation). One
# projection on the same inputs differs by the accumulation alone: the tight check that catches a wrong scale or
# layout. FP8 × FP8 on the H200 moved 3.2 % from it at K = 4,096–14,336 (its tensor cores' FP8 accumulation keeps
# fewer bits than float32; a wrong scale moves by a factor), int8 accumulates exactly in int32. A 32-layer random
# model's logits also compound the steps' bfloat16 roundings, each of which can flip an activation's 8-bit rounding
# (one float8 step is 6 %): a loose bound by activations.
PROJECTION_TOLERANCE = {"fp8": 6e-2, "int8": 2e-2, None: 2e-2}
LOGITS_TOLERANCE = {"fp8": 0.5, "int8": 0.25, None: 0.05}


def model_spec(shape: dict):
    from jengine.models.registry import spec_from_hf_config

    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, hidden_act="silu",
                  rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
                  torch_dtype="bfloat16", **shape)
    return spec_from_hf_config(config)


def random_params(spec, seed: int = 0) -> dict:
    """bfloat16 weights in the loader's layout (fused q/k/v and gate/up), std 0.02, norms at 1."""
    import jax
    import jax.numpy as jnp

    d, f, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * hd
    shapes = {"wqkv": (d, qkv), "wo": (spec.num_heads * hd, d), "w_gate_up": (d, 2 * f), "w_down": (f, d)}
    key = jax.random.key(seed)

    def normal(shape, std=0.02):
        nonlocal key
        key, sub = jax.random.split(key)
        return (jax.random.normal(sub, shape, jnp.float32) * std).astype(jnp.bfloat16)

    layers = tuple({"attn_norm": jnp.ones((d,), jnp.bfloat16), "mlp_norm": jnp.ones((d,), jnp.bfloat16),
                    **{name: normal(shape) for name, shape in shapes.items()}} for _ in range(spec.num_layers))
    return {"embed": normal((spec.vocab_size, d), 1.0), "final_norm": jnp.ones((d,), jnp.bfloat16),
            "layers": layers, "lm_head": normal((spec.vocab_size, d))}


def quantize(w, variant: tuple, impl: str = "xla"):
    """One bfloat16 [K, N] weight → a QuantizedWeight of the variant (amax scales, float8 clipped, int8 rounded)."""
    import jax.numpy as jnp

    from jengine.layers.quant import FP8, FP8_MAX, INT8_MAX, QuantizedWeight, QuantScheme, expand_scale

    import jax

    kind, acts, block_k, block_n, group = variant[:5]
    impl = variant[5] if len(variant) > 5 else impl
    if impl in ("pallas", "mosaic") and jax.devices()[0].platform == "cpu":
        impl += "_interpret"
    scheme = QuantScheme(kind, acts, block_k, block_n, group, impl)
    k, n = w.shape
    wf = jnp.abs(w.astype(jnp.float32))
    if block_k:
        amax = wf.reshape(k // block_k, block_k, n // block_n, block_n).max(axis=(1, 3))
    else:
        amax = wf.max(axis=0, keepdims=True)
    top = FP8_MAX if kind == "fp8" else INT8_MAX
    scale = jnp.maximum(amax / top, 1e-12)
    scaled = jnp.clip(w.astype(jnp.float32) / expand_scale(scale, scheme, k, n), -top, top)
    weight = scaled.astype(FP8) if kind == "fp8" else jnp.round(scaled).astype(jnp.int8)
    return QuantizedWeight.from_kn(weight, scale, None, scheme)


def quantized_params(params: dict, variant: tuple | None, impl: str = "xla") -> dict:
    import jax

    if variant is None:
        return params
    projections = ("wqkv", "wo", "w_gate_up", "w_down")
    quant = jax.jit(lambda w: quantize(w, variant, impl))
    layers = tuple({k: (quant(v) if k in projections else v) for k, v in layer.items()} for layer in params["layers"])
    return {**params, "layers": layers}


def with_impl(params: dict, impl: str) -> dict:
    """The same 8-bit weights, multiplied by another implementation (no copy of the arrays)."""
    from jengine.layers.quant import QuantizedWeight

    def swap(leaf):
        if isinstance(leaf, QuantizedWeight):
            return dataclasses.replace(leaf, scheme=dataclasses.replace(leaf.scheme, impl=impl))
        return leaf

    layers = tuple({k: swap(v) for k, v in layer.items()} for layer in params["layers"])
    return {**params, "layers": layers}


def param_bytes_read(params: dict) -> int:
    """What a decode step reads of the weights: all but the embedding table (one row of it)."""
    import jax

    from jengine.layers.quant4 import stored_bytes

    return sum(stored_bytes(leaf) for leaf in jax.tree.leaves({k: v for k, v in params.items() if k != "embed"}))


@dataclasses.dataclass
class Case:
    """One step shape: `query` new tokens of one sequence that then holds `context` tokens."""

    name: str
    query: int
    context: int


def make_case(spec, case: Case, dtype):
    """(jitted step, its metadata, token ids, a fresh KV cache) for one sequence."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jengine.attention.backend import select_backend
    from jengine.attention.metadata import build_metadata
    from jengine.layers.attention import allocate_kv_cache
    from jengine.models.decoder import compute_logits, forward

    backend = select_backend(jax.devices()[0].platform, head_dim=spec.head_dim)
    blocks = -(-case.context // BLOCK)
    md = build_metadata([case.query], [case.context], [list(range(blocks))], block_size=BLOCK,
                        num_slots=(blocks + 1) * BLOCK, max_query_len=case.query)
    tokens = jnp.asarray(np.arange(case.query, dtype=np.int32) % spec.vocab_size)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, kv, tokens, md):
        hidden, kv = forward(spec, backend, params, kv, tokens, md)
        return compute_logits(spec, params, hidden[-1:]), kv

    def fresh_kv():
        return allocate_kv_cache(spec, blocks + 1, BLOCK, dtype)

    return step, md, tokens, fresh_kv


def time_step(step, params, md, tokens, fresh_kv, runs: int, calls: int) -> float:
    state = {"kv": fresh_kv()}

    def call():
        logits, state["kv"] = step(params, state["kv"], tokens, md)
        return logits

    return common.replay_seconds(call, warmup=3, runs=runs, calls=calls)


def hlo_gemms(text: str) -> dict[str, int]:
    return {"fp8_gemm": text.count('custom_call_target="__cublas$lt$matmul$f8"'),
            "cublaslt_gemm": text.count('custom_call_target="__cublas$lt$matmul"'),
            "cublas_gemm": text.count('custom_call_target="__cublas$gemm"'),
            "triton_gemm": text.count("__triton_gemm")}


def relative_error(ours, ref) -> float:
    import numpy as np

    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


def oracle(q, tokens: int) -> str:
    """The math a variant is checked against: `emulated` (its activations' 8-bit rounding), or `reference` where
    the Pallas decode kernel runs (few tokens), whose activations stay unquantized."""
    from jengine.layers.quant import PALLAS_MAX_TOKENS

    return "reference" if q.scheme.impl.startswith("pallas") and tokens <= PALLAS_MAX_TOKENS else "emulated"


def check_projections(params: dict, variant: tuple, tokens_list: list[int]) -> dict[str, float]:
    """Layer 0's projections on `tokens` rows: the variant's math vs the emulated math on the same 8-bit weights."""
    import jax
    import jax.numpy as jnp

    from jengine.layers.quant import quantized_matmul

    errors = {}
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        q = params["layers"][0][name]
        for t in tokens_list:
            x = jax.random.normal(jax.random.key(t), (t, q.shape[0]), jnp.float32).astype(jnp.bfloat16)
            ours = jax.jit(quantized_matmul)(x, q)
            ref = jax.jit(quantized_matmul)(x, dataclasses.replace(q, scheme=dataclasses.replace(q.scheme,
                                                                                                 impl=oracle(q, t))))
            errors[f"{name}_t{t}"] = relative_error(ours, ref)
    return errors


def run_variant(name: str, spec, base: dict, cases: list[Case], args, out: dict) -> None:
    """Checks, then times, one variant; its figures go into `out['metrics']`."""
    import time

    import jax.numpy as jnp

    variant = VARIANTS[name]
    params = quantized_params(base, variant)
    metrics = out["metrics"]
    metrics[f"{name}_weight_bytes_read"] = param_bytes_read(params)
    for case in cases:
        step, md, tokens, fresh_kv = make_case(spec, case, jnp.bfloat16)
        start = time.perf_counter()
        compiled = step.lower(params, fresh_kv(), tokens, md).compile()
        metrics[f"{name}_{case.name}_compile_s"] = time.perf_counter() - start
        log(f"{name} {case.name}: compiled in {time.perf_counter() - start:.1f} s")
        for key, count in hlo_gemms(compiled.as_text()).items():
            metrics[f"{name}_{case.name}_hlo_{key}"] = count
        if variant is not None:
            errors = check_projections(params, variant, sorted({1, case.query}))
            metrics[f"{name}_{case.name}_projection_max_rel_err"] = worst = max(errors.values())
            if worst > PROJECTION_TOLERANCE[variant[1]]:
                raise SystemExit(f"{name} {case.name}: projections' max rel. error {worst:.3g} ({errors})")
            if case.name.startswith("decode"):
                ours = compiled(params, fresh_kv(), tokens, md)[0]
                ref = step(with_impl(params, oracle(params["layers"][0]["wqkv"], case.query)), fresh_kv(), tokens, md)[0]
                metrics[f"{name}_{case.name}_logits_max_rel_err"] = err = relative_error(ours, ref)
                if err > LOGITS_TOLERANCE[variant[1]]:
                    raise SystemExit(f"{name} {case.name}: logits' max rel. error {err:.3g}")
        seconds = time_step(compiled, params, md, tokens, fresh_kv, args.runs, args.calls)
        metrics[f"{name}_{case.name}_s"] = seconds
        log(f"{name} {case.name}: {seconds * 1e3:.3f} ms/step (checks + compile + timing "
            f"{time.perf_counter() - start:.1f} s)")
    del params


def kv_bytes(spec, context: int) -> int:
    return spec.num_layers * context * 2 * spec.num_kv_heads * spec.head_dim * 2  # bfloat16 K and V


def ratios(metrics: dict, floor_s: float | None) -> dict[str, float]:
    m, r = metrics, {}

    def ratio(key: str, num: str, den: str) -> None:
        if num in m and den in m:
            r[key] = m[num] / m[den]

    ratio("fp8_decode_b1_vs_bf16", "bf16_decode_b1_s", "fp8_channel_decode_b1_s")
    if "fp8_channel_decode_b1_s" in m and floor_s:
        r["fp8_decode_b1_vs_floor"] = m["fp8_channel_decode_b1_s"] / floor_s
    ratio("fp8_prefill_vs_bf16", "bf16_prefill_s", "fp8_channel_prefill_s")
    ratio("fp8_block_vs_channel_decode_b1", "fp8_channel_decode_b1_s", "fp8_block_decode_b1_s")
    ratio("fp8_block_vs_channel_prefill_4k", "fp8_channel_prefill_s", "fp8_block_prefill_s")
    ratio("int8_w8a16_decode_b1_vs_bf16", "bf16_decode_b1_s", "int8_w8a16_decode_b1_s")
    ratio("int8_w8a8_prefill_vs_bf16", "bf16_prefill_s", "int8_w8a8_prefill_s")
    # the same decode ratios with the Pallas kernel (not the keys: which implementation serves is open)
    ratio("fp8_pallas_decode_b1_vs_bf16", "bf16_decode_b1_s", "fp8_channel_pallas_decode_b1_s")
    if "fp8_channel_pallas_decode_b1_s" in m and floor_s:
        r["fp8_pallas_decode_b1_vs_floor"] = m["fp8_channel_pallas_decode_b1_s"] / floor_s
    ratio("int8_w8a16_pallas_decode_b1_vs_bf16", "bf16_decode_b1_s", "int8_w8a16_pallas_decode_b1_s")
    ratio("int8_w8a16_mosaic_decode_b1_vs_bf16", "bf16_decode_b1_s", "int8_w8a16_mosaic_decode_b1_s")
    ratio("fp8_mosaic_decode_b1_vs_bf16", "bf16_decode_b1_s", "fp8_channel_mosaic_decode_b1_s")
    if "fp8_channel_mosaic_decode_b1_s" in m and floor_s:
        r["fp8_mosaic_decode_b1_vs_floor"] = m["fp8_channel_mosaic_decode_b1_s"] / floor_s
    ratio("fp8_w8a16_decode_b1_vs_bf16", "bf16_decode_b1_s", "fp8_w8a16_decode_b1_s")
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (the CPU check of the script)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--context", type=int, default=1024, help="tokens in the cache at the decode step")
    parser.add_argument("--prefill", type=int, default=4096, help="tokens of the prefill chunk")
    parser.add_argument("--only", default="decode,prefill")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--merge", nargs="+", metavar="RESULTS", help="merge these results files into --out and exit")
    args = parser.parse_args()
    if args.merge:
        records = [common.read_record(path) for path in args.merge]
        merged = records[0]
        for record in records[1:]:
            merged = common.merge_records(merged, record)
        common.write_record(args.out, merged)
        common.print_tables(merged)
        return

    import time

    started = time.perf_counter()
    spec = model_spec(TINY if args.tiny else LLAMA_31_8B)
    prefill = min(args.prefill, 256) if args.tiny else args.prefill
    cases = [c for c in (Case("decode_b1", 1, args.context), Case("prefill", prefill, prefill))
             if c.name.split("_")[0] in args.only.split(",")]
    _, copy_rate = common.copy_bandwidth(1 << 24 if args.tiny else 1 << 30)
    out: dict[str, Any] = {"metrics": {"copy_bytes_per_s": copy_rate, "context_tokens": args.context,
                                       "prefill_tokens": prefill, "layers": spec.num_layers}}
    base = random_params(spec)
    log(f"weights made ({time.perf_counter() - started:.1f} s since start)")
    for name in args.variants.split(","):
        run_variant(name, spec, base, cases, args, out)
        record = save(args, spec, out)  # after each variant: a call cut short keeps what it measured
    common.print_tables(record)


def save(args, spec, out: dict) -> dict:
    metrics = out["metrics"]
    floor_s = None
    if "fp8_channel_weight_bytes_read" in metrics:
        floor_bytes = metrics["fp8_channel_weight_bytes_read"] + kv_bytes(spec, args.context)
        floor_s = floor_bytes / metrics["copy_bytes_per_s"]
        metrics["fp8_decode_b1_floor_s"] = floor_s
    record = common.result_record("quant8", args.git_sha, common.jax_device_name(), common.versions(),
                                  " ".join(["python", *sys.argv]), metrics, ratios(metrics, floor_s),
                                  shape="tiny" if args.tiny else "Llama-3.1-8B (random weights)")
    path = Path(args.out)
    if path.exists():
        record = common.merge_records(common.read_record(path), record)
    common.write_record(path, record)
    return record


if __name__ == "__main__":
    main()
