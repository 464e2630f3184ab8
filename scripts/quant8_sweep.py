"""Sweep of the 8-bit few-row matmul (`pallas_kernels/quant_matmul`) on the GPU, beside XLA's weight-only dot and
bfloat16 dots, on the projections of 8 Llama-3.1-8B-shaped layers (fused q/k/v, o, fused gate/up, down; 3.5 GB in
bf16, 1.7 GB at 8 bits: far beyond L2), for float8 and int8 weights with one scale per output column.

Row counts 1 and 16: a batch-1 decode step of the engine runs its projections on 16 rows (the smallest token
bucket), one of them real, so 16 is what serving pays and 1 the lower bound. Every candidate is checked against the
reference (upcast, float32 matmul, scales) on every projection before it is timed; one that fails to lower,
compile or match is reported with its error and the others go on. The floor is the 8-bit weights and their scales
÷ the copy rate measured in the same call.

    PYTHONPATH=. python scripts/quant8_sweep.py --out $OUT/quant8_sweep.json --git-sha <sha>
    XLA_FLAGS=--xla_gpu_exhaustive_tiling_search=true PYTHONPATH=. python scripts/quant8_sweep.py --xla-only ...
    PYTHONPATH=. python scripts/quant8_sweep.py --tiny --out /tmp/quant8_sweep.json     # CPU shape check
(`--xla-only` times XLA's dots alone: run it under another XLA_FLAGS to see what XLA's own tiling search finds.)
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_bench_common as common  # noqa: E402
from gpu_bench_common import log  # noqa: E402
from quant4_sweep import Trial, compile_trials, print_table, run_trial, summarize  # noqa: E402

from pallas_kernels.quant_matmul import FewTokenConfig  # noqa: E402

LLAMA_31_8B = dict(layers=8, shapes=((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)))
TINY = dict(layers=2, shapes=((256, 384), (256, 256), (256, 1024), (512, 256)))


def candidates(quick: bool) -> list[FewTokenConfig]:
    """Column strips × K tiles × warps × stages, unsplit and split to fill 2 or 4 programs per SM."""
    out = [FewTokenConfig()]  # the engine's default
    out += [FewTokenConfig(bn, bk, w, s, p) for bn, bk in ((16, 512), (32, 256), (32, 128), (64, 128), (64, 256),
                                                           (128, 128), (128, 64))
            for w, s in ((4, 3), (4, 4), (8, 3)) for p in (0, 264, 528)]
    return out[::12] if quick else out


def random_layers(shape: dict, weight_dtype):
    """Per layer and projection: the bf16 `[k, n]` weight and its 8-bit `[n, k]` values + column scales."""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def one(key, k: int, n: int):
        w = (jax.random.normal(key, (n, k), jnp.float32) * 0.02)
        top = 448.0 if weight_dtype == jnp.float8_e4m3fn else 127.0
        scale = jnp.max(jnp.abs(w), axis=1) / top
        scaled = jnp.clip(w / scale[:, None], -top, top)
        q = scaled.astype(weight_dtype) if weight_dtype == jnp.float8_e4m3fn else jnp.round(scaled).astype(jnp.int8)
        return w.T.astype(jnp.bfloat16), q, scale

    keys = iter(jax.random.split(jax.random.key(0), shape["layers"] * len(shape["shapes"])))
    return [[one(next(keys), k, n) for k, n in shape["shapes"]] for _ in range(shape["layers"])]


def step_for(matmul):
    """Every projection of every layer on the activation of its input width, one jitted call."""
    import jax

    @jax.jit
    def step(xs, quantized):
        return [matmul(xs[q.shape[1]], q, s) for q, s in quantized]
    return step


def reference(x, q, scale):
    import jax
    import jax.numpy as jnp

    y = jnp.dot(x.astype(jnp.float32), q.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    return (y * scale[None, :]).astype(x.dtype)


def xla_weight_only(x, q, scale):
    """What `layers/quant.py`'s `xla` path does for weight-only schemes: the upcast inside the dot."""
    import jax
    import jax.numpy as jnp

    y = jax.lax.dot_general(x, q.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * scale[None, :]).astype(x.dtype)


def kernel_for(config: FewTokenConfig, interpret: bool):
    from pallas_kernels.quant_matmul import few_token_matmul

    def matmul(x, q, scale):
        return few_token_matmul(x, q, scale, interpret=interpret, **config.kernel_args(*q.shape))
    return matmul


def sweep_rows(layers, rows: int, args, deadline: float) -> dict:
    import jax
    import jax.numpy as jnp

    widths = sorted({m[1].shape[1] for m in layers[0]})
    xs = {k: jax.random.normal(jax.random.key(k), (rows, k), jnp.bfloat16) for k in widths}
    dense = [m[0] for layer in layers for m in layer]
    quantized = [m[1:] for layer in layers for m in layer]
    call_args = (xs, quantized)
    refs = step_for(reference)(*call_args)
    bf16_s = common.timeit(jax.jit(lambda xs, ws: [xs[w.shape[0]] @ w for w in ws]), xs, dense)
    trials = [Trial("xla weight-only dot", None)]
    if not args.xla_only:
        trials += [Trial(cfg.label(), cfg) for cfg in dict.fromkeys(candidates(args.quick))]

    def make_step(trial: Trial):
        return step_for(xla_weight_only if trial.config is None else kernel_for(trial.config, args.tiny))

    start = time.perf_counter()
    compile_trials(trials, call_args, make_step, args.threads)
    log(f"rows {rows}: compiled {len(trials)} candidates in {time.perf_counter() - start:.0f} s")
    for trial in trials:
        run_trial(trial, call_args, refs, deadline)
    return summarize(rows, bf16_s, trials)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--tiny", action="store_true", help="small shapes, interpret mode (CPU shape check)")
    parser.add_argument("--quick", action="store_true", help="a few candidates only")
    parser.add_argument("--xla-only", action="store_true", help="XLA's weight-only dot alone (no Pallas candidates)")
    parser.add_argument("--weights", default="fp8,int8")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds; later candidates are skipped")
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args()
    import jax.numpy as jnp

    shape = TINY if args.tiny else LLAMA_31_8B
    _, copy_rate = common.copy_bandwidth(1 << 24 if args.tiny else 1 << 30)
    deadline = time.perf_counter() + args.budget
    metrics, ratios = {"copy_bytes_per_s": copy_rate}, {}
    for kind in args.weights.split(","):
        layers = random_layers(shape, jnp.float8_e4m3fn if kind == "fp8" else jnp.int8)
        floor_s = sum(q.nbytes + s.nbytes for layer in layers for _, q, s in layer) / copy_rate
        metrics[f"{kind}_floor_s"] = floor_s
        for rows in (int(r) for r in args.rows.split(",")):
            summary = sweep_rows(layers, rows, args, deadline)
            print_table(summary, floor_s)
            metrics[f"{kind}_rows{rows}"] = summary
            xla = next(r for r in summary["results"] if r["config"] is None)
            for name, result in (("best", summary["best"]), ("xla", xla)):
                if result and result["seconds"]:
                    ratios[f"{kind}_{name}_rows{rows}_vs_bf16"] = summary["bf16_s"] / result["seconds"]
                    ratios[f"{kind}_{name}_rows{rows}_vs_floor"] = result["seconds"] / floor_s
        del layers
    record = common.result_record("quant8_sweep", args.git_sha, common.jax_device_name(), common.versions(),
                                  " ".join(["python", *sys.argv]), metrics, ratios,
                                  shape="tiny" if args.tiny else "8 Llama-3.1-8B layers' projections")
    common.write_record(args.out, record)
    log({k: round(v, 3) for k, v in ratios.items()})


if __name__ == "__main__":
    main()
