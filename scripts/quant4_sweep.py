"""Sweep of W4A16 kernel configurations on the GPU (`scripts/bench_quant4.py --sweep`): for 1, 64 and 4,096 rows,
every candidate of `candidates()` through the projections of 8 Llama-3.1-8B-shaped layers (`bench_quant4.py`'s
weights), checked against the reference (unpack, dequantize, XLA matmul) on every projection before it is timed,
beside the first kernel (`quant4_previous_kernel.py`) and bfloat16 XLA dots. A configuration that fails to lower,
compile or match is reported with its error and the others go on. The candidates compile in parallel threads
(Triton and ptxas run outside the GIL), then run one at a time.

    PYTHONPATH=. python scripts/bench_quant4.py --sweep --out $OUT/quant4_sweep.json      # on the H200, ~4 min
    PYTHONPATH=. python scripts/bench_quant4.py --sweep --tiny --out /tmp/sweep.json     # CPU shape check

The JSON holds every candidate's error and seconds, and `winners`: the fastest correct configuration per row count,
which `bench_quant4.py --configs FILE` gives the model-level run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
import time

import gpu_bench_common as common
from gpu_bench_common import log

from pallas_kernels.w4a16 import W4A16Config, default_config

GROUP = 128
MAX_REL_ERROR = 2e-2  # bfloat16 outputs: the kernels accumulate in float32 in another order than XLA's dot


def gemv_candidates() -> list[W4A16Config]:
    """Decode, batch 1: column strips × warps × how many programs the K split aims for, prefetch, stages."""
    out = [W4A16Config("gemv", block_m=1, block_n=bn, num_warps=w, min_programs=p)
           for bn in (128, 256, 512) for w in (4, 8) for p in (264, 528)]
    out += [W4A16Config("gemv", block_m=1, block_n=bn, num_warps=w, min_programs=p, prefetch=True)
            for bn, w, p in ((128, 4, 528), (256, 4, 264), (256, 8, 528), (512, 8, 528))]
    out += [W4A16Config("gemv", block_m=1, block_n=bn, num_warps=2, min_programs=528) for bn in (64, 128, 256)]
    out += [W4A16Config("gemv", block_m=1, block_n=256, num_warps=4, min_programs=p) for p in (132, 1056)]
    out += [W4A16Config("gemv", block_m=1, block_n=256, num_warps=4, min_programs=264, num_stages=s) for s in (1, 3)]
    out += [W4A16Config("gemv", block_m=1, block_n=bn, num_warps=w, min_programs=0) for bn, w in ((64, 2), (128, 4))]
    return out + [W4A16Config("dot", block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3)]


def dot_candidates(rows: int) -> list[W4A16Config]:
    """Batch decode (64 rows): tensor-core tiles over all rows, narrower column strips or K split to fill the GPU."""
    bm = min(rows, 64)
    out = [W4A16Config("dot", block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s, min_programs=p)
           for bn, bk, w, s, p in ((64, 128, 4, 3, 264), (128, 128, 4, 3, 264), (128, 128, 8, 3, 264),
                                   (256, 128, 8, 3, 264), (128, 64, 4, 4, 264), (128, 256, 4, 2, 264),
                                   (128, 256, 8, 3, 264), (64, 256, 4, 3, 264), (128, 128, 4, 3, 132),
                                   (128, 128, 4, 3, 528), (64, 128, 4, 3, 528), (128, 128, 4, 2, 264),
                                   (128, 128, 4, 4, 264), (128, 64, 8, 3, 264), (64, 64, 4, 3, 528))]
    out += [W4A16Config("dot", block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=3, planes=True)
            for bn, bk, w in ((128, 128, 4), (128, 256, 4), (128, 512, 4), (64, 512, 4), (128, 512, 8))]
    out += [W4A16Config("dot", block_m=16 if bm > 16 else bm, block_n=128, block_k=128, num_warps=4, num_stages=3),
            W4A16Config("dot", block_m=32 if bm > 32 else bm, block_n=128, block_k=128, num_warps=4, num_stages=3)]
    return out + [W4A16Config("dequant")]


def prefill_candidates() -> list[W4A16Config]:
    """A prefill chunk: dequantize + cuBLAS against wide tensor-core tiles."""
    tiles = ((128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 3),
             (128, 128, 64, 4, 4), (256, 128, 64, 8, 3), (128, 64, 128, 4, 3))
    out = [W4A16Config("dot", block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s, min_programs=0)
           for bm, bn, bk, w, s in tiles]
    return [W4A16Config("dequant")] + out


def candidates(rows: int, quick: bool = False) -> list[W4A16Config]:
    """The sweep's configurations for `rows`; `quick`: the few the plain bench tries (the defaults among them)."""
    if rows == 1:
        full = gemv_candidates()
    elif rows <= 256:
        full = dot_candidates(rows)
    else:
        full = prefill_candidates()
    return full[:: max(len(full) // 4, 1)][:4] if quick else full


@dataclasses.dataclass
class Trial:
    label: str
    config: W4A16Config | None  # None: the first kernel
    compiled: object = None
    error: str | None = None
    rel_error: float | None = None
    seconds: float | None = None
    compile_s: float | None = None


def step_for(matmul):
    """Every projection of every layer on the activation of its input width, one jitted call."""
    import jax

    @jax.jit
    def step(xs, quantized):
        return [matmul(xs[p.shape[0] * 8], p, z, s) for p, z, s in quantized]
    return step


def kernel_for(cfg: W4A16Config | None, interpret: bool, rows: int):
    from pallas_kernels.w4a16 import w4a16_matmul
    from quant4_previous_kernel import previous_w4a16_matmul

    if cfg is None:  # the first kernel at the tile its bench picked for this row count
        block_m, block_n = (16, 32) if rows == 1 else (16, 64) if rows <= 64 else (64, 128)
        return functools.partial(previous_w4a16_matmul, group=GROUP, block_m=block_m, block_n=block_n,
                                 interpret=interpret)
    return functools.partial(w4a16_matmul, group=GROUP, config=cfg, interpret=interpret)


def compile_trials(trials: list[Trial], args, make_step, threads: int) -> None:
    """Lower and compile every trial's `make_step(trial)` (errors kept on the trial, never raised). Tracing and
    lowering are Python (one thread at a time under a lock); XLA's and Triton's compilation run concurrently."""
    lowering = threading.Lock()

    def build(trial: Trial) -> None:
        start = time.perf_counter()
        try:
            with lowering:
                lowered = make_step(trial).lower(*args)
            trial.compiled = lowered.compile()
        except Exception as exc:  # noqa: BLE001 - one bad configuration must not stop the sweep
            trial.error = f"compile: {type(exc).__name__}: {str(exc)[:300]}"
        trial.compile_s = time.perf_counter() - start

    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(build, trials))


def max_rel_error(outs, refs) -> float:
    import jax.numpy as jnp

    worst = [jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32))) / jnp.max(jnp.abs(r.astype(jnp.float32)))
             for o, r in zip(outs, refs, strict=True)]
    return float(jnp.max(jnp.stack(worst)))


def run_trial(trial: Trial, args, refs, deadline: float) -> None:
    """Check, then time, one compiled trial (errors kept on the trial)."""
    if trial.compiled is None:
        return
    if time.perf_counter() > deadline:
        trial.error = "skipped: the sweep's time budget was spent"
        return
    try:
        trial.rel_error = max_rel_error(trial.compiled(*args), refs)
        if not trial.rel_error <= MAX_REL_ERROR:
            trial.error = f"wrong: max rel. error {trial.rel_error:.3g} > {MAX_REL_ERROR}"
            return
        trial.seconds = common.timeit(trial.compiled, *args)
    except Exception as exc:  # noqa: BLE001 - a launch failure must not stop the sweep
        trial.error = f"run: {type(exc).__name__}: {str(exc)[:300]}"
    finally:
        trial.compiled = None  # frees the executable


def sweep_rows(layers, rows: int, interpret: bool, deadline: float, quick: bool, threads: int,
               extra: dict | None) -> dict:
    """One row count: bf16 and reference outputs, then every candidate; a JSON-ready summary."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.w4a16 import w4a16_matmul_reference

    widths = sorted({m[0].shape[0] for m in layers[0]})
    xs = {k: jax.random.normal(jax.random.key(k), (rows, k), jnp.bfloat16) for k in widths}
    dense = [m[0] for layer in layers for m in layer]
    quantized = [m[1:] for layer in layers for m in layer]
    args = (xs, quantized)
    refs = step_for(functools.partial(w4a16_matmul_reference, group=GROUP))(*args)
    bf16 = jax.jit(lambda xs, ws: [xs[w.shape[0]] @ w for w in ws])
    bf16_s = common.timeit(bf16, xs, dense)
    configs = candidates(rows, quick) + [default_config(rows)] + ([W4A16Config(**extra)] if extra else [])
    trials = [Trial(cfg.label(), cfg) for cfg in dict.fromkeys(configs)]
    trials.append(Trial("previous kernel", None))
    start = time.perf_counter()
    compile_trials(trials, args, lambda t: step_for(kernel_for(t.config, interpret, rows)), threads)
    log(f"rows {rows}: compiled {len(trials)} candidates in {time.perf_counter() - start:.0f} s")
    for trial in trials:
        run_trial(trial, args, refs, deadline)
    del refs
    return summarize(rows, bf16_s, trials)


def summarize(rows: int, bf16_s: float, trials: list[Trial]) -> dict:
    results = [{"label": t.label, "config": None if t.config is None else dataclasses.asdict(t.config),
                "seconds": t.seconds, "vs_bf16": None if t.seconds is None else bf16_s / t.seconds,
                "max_rel_error": t.rel_error, "error": t.error, "compile_s": t.compile_s} for t in trials]
    timed = [r for r in results if r["seconds"] is not None and r["config"] is not None]
    best = min(timed, key=lambda r: r["seconds"]) if timed else None
    return {"rows": rows, "bf16_s": bf16_s, "results": results, "best": best}


def print_table(summary: dict, floor_s: float | None) -> None:
    log(f"--- {summary['rows']} rows: bf16 {summary['bf16_s'] * 1e3:.3f} ms"
        + (f", floor {floor_s * 1e3:.3f} ms" if floor_s else ""))
    for r in sorted(summary["results"], key=lambda r: (r["seconds"] is None, r["seconds"] or 0)):
        if r["seconds"] is None:
            log(f"  {r['label']:<44} FAILED  {r['error']}")
        else:
            tail = f"  {r['seconds'] / floor_s:5.2f}× floor" if floor_s else ""
            log(f"  {r['label']:<44} {r['seconds'] * 1e3:9.3f} ms  {r['vs_bf16']:5.2f}× bf16  "
                f"err {r['max_rel_error']:.1e}{tail}")


def sweep(layers, row_counts, interpret: bool, floor_s: float, budget_s: float, quick: bool = False,
          threads: int = 16, extra: dict | None = None) -> dict:
    """Every row count; `winners` maps a row count to the fastest correct configuration (as a dict); `extra`
    (row count → config dict, an earlier sweep's winners) joins the candidates of its row count."""
    deadline = time.perf_counter() + budget_s
    summaries = []
    for rows in row_counts:
        try:
            summaries.append(sweep_rows(layers, rows, interpret, deadline, quick, threads,
                                        (extra or {}).get(str(rows))))
        except Exception as exc:  # noqa: BLE001 - report the row count, go on with the next
            log(f"rows {rows}: the sweep failed: {type(exc).__name__}: {exc}")
            summaries.append({"rows": rows, "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
            continue
        print_table(summaries[-1], floor_s if rows == 1 else None)
    winners = {str(s["rows"]): s["best"]["config"] for s in summaries if s.get("best")}
    return {"sweep": summaries, "winners": winners, "decode_floor_s": floor_s}


def configs_from(winners: dict) -> tuple:
    """`Int4Weight.configs` from a sweep's winners (row count → config dict): the batch-1 winner serves up to
    `GEMV_MAX_ROWS` rows, the 64-row one up to `DOT_MAX_ROWS`, the prefill one beyond."""
    from pallas_kernels.w4a16.config import DOT_MAX_ROWS, GEMV_MAX_ROWS

    def limit(rows: int) -> int:
        return GEMV_MAX_ROWS if rows <= GEMV_MAX_ROWS else DOT_MAX_ROWS if rows <= DOT_MAX_ROWS else 1 << 30
    ordered = sorted(winners.items(), key=lambda item: int(item[0]))
    return tuple((limit(int(rows)), W4A16Config(**cfg)) for rows, cfg in ordered)
