"""The Mosaic GPU weight-only kernel (`pallas_kernels/weight_only`) against the paths it would replace, on the GPU.

8 Llama-3.1-8B-shaped layers' projections (qkv 4096→6144, o 4096→4096, gate/up 4096→28672, down 14336→4096) in
one jit, so the weights stream from HBM (no L2 reuse): int4 with group-128 scales, int8 and float8 e4m3 per channel,
at 1, 16 and 64 rows. Each candidate is checked against a float32 dequantized reference on every projection before it is
timed; beside it, in the same process: the bfloat16 XLA dot, the Triton W4A16 kernel (int4) and XLA's
upcast-in-the-dot (int8, float8: the engine's `xla` path), and the device-to-device copy rate for the bytes floor.

    PYTHONPATH=. python scripts/probe_weight_only_gpu.py --out $OUT/weight_only.json --git-sha <sha>
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time

import gpu_bench_common as common
import jax
import jax.numpy as jnp
import numpy as np
from gpu_bench_common import log

from pallas_kernels.weight_only.kernel import WeightOnlyConfig, default_config, weight_only_matmul

INT4_DECODE = ((64, 128, 4, 264), (64, 256, 4, 264), (128, 256, 4, 264), (128, 512, 4, 132), (64, 512, 4, 264),
               (128, 256, 8, 264), (64, 256, 8, 528), (128, 512, 2, 264), (128, 256, 4, 132),
               (64, 256, 8, 0), (64, 256, 8, 132), (64, 512, 4, 528),  # no split: no partial sums to add
               (64, 256, 8, 528, True), (64, 256, 4, 264, True), (128, 256, 4, 264, True), (64, 512, 4, 528, True),
               (64, 256, 8, 528, False, True), (64, 256, 8, 528, True, True), (64, 256, 4, 264, False, True),
               # (..., resident_x, one_accumulator, warp_specialized)
               (128, 256, 8, 264, False, False, True), (128, 256, 4, 264, False, False, True),
               (64, 256, 8, 528, False, False, True), (128, 256, 8, 0, False, False, True),
               # (..., warp_specialized, persistent)
               (64, 256, 8, 0, False, False, False, 132), (64, 256, 8, 0, False, False, False, 264),
               (64, 256, 16, 0, False, False, False, 132), (128, 256, 8, 0, False, False, False, 132))
INT4_BATCH = ((64, 256, 4, 264), (128, 256, 4, 264), (128, 256, 3, 264), (128, 512, 2, 132), (64, 256, 4, 264, True),
              (64, 256, 4, 528, True), (64, 256, 4, 264, False, True), (128, 256, 3, 264, False, True))
INT8 = ((64, 128, 4, 264), (64, 256, 4, 264), (128, 256, 4, 264), (64, 256, 8, 528), (64, 256, 8, 0),
        (64, 256, 4, 264, True), (64, 256, 8, 528, True),  # (..., resident_x, one_accumulator)
        (64, 256, 4, 264, False, True), (64, 256, 8, 528, False, True),
        (128, 256, 8, 264, False, False, True), (64, 256, 8, 528, False, False, True))
# --per-shape: how a shape's programs are cut (splits, steps in flight) may differ from the joint best
PER_SHAPE_INT4 = ((64, 256, 8, 528), (64, 256, 4, 264), (64, 256, 8, 132), (64, 256, 8, 0), (64, 512, 4, 528),
                  (128, 256, 4, 132), (64, 256, 8, 528, False, True), (64, 256, 4, 264, False, True),
                  (64, 256, 8, 132, False, True), (64, 256, 8, 0, False, True),
                  (128, 256, 8, 264, False, False, True), (128, 256, 8, 132, False, False, True),
                  (64, 256, 8, 528, False, False, True), (128, 256, 8, 0, False, False, True),
                  (64, 256, 8, 0, False, False, False, 132), (64, 256, 8, 0, False, False, False, 264),
                  (64, 256, 16, 0, False, False, False, 132), (128, 256, 8, 0, False, False, False, 132))
SHAPES = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))  # (K, N) of qkv, o, gate/up, down
TINY_SHAPES = ((256, 384), (256, 256), (256, 1024), (512, 256))  # --tiny: the CPU check, in Mosaic's interpreter
GROUP = 128
MAX_REL_ERROR = 2e-2


def make_layers(layers: int, dtype, seed: int, shapes: tuple):
    """Per layer and projection: (q [N, K] signed ints, scales [G, N] float32)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        projections = []
        for k, n in shapes:
            if dtype == jnp.int4:
                q = rng.integers(-8, 8, (n, k), dtype=np.int8)
                scales = rng.uniform(0.5, 1.5, (k // GROUP, n)).astype(np.float32) * 0.02
            elif dtype == jnp.int8:
                q = rng.integers(-127, 128, (n, k), dtype=np.int8)
                scales = rng.uniform(0.5, 1.5, (1, n)).astype(np.float32) * 2e-3
            else:  # float8 e4m3 over its whole range
                q = rng.uniform(-448, 448, (n, k)).astype(np.float32)
                scales = rng.uniform(0.5, 1.5, (1, n)).astype(np.float32) * 6e-4
            projections.append((jnp.asarray(q).astype(dtype), jnp.asarray(scales)))
        out.append(projections)
    return out


def weight_bytes(layers, bits: int) -> int:
    """The bytes a chain of (q, scales) projections reads: `bits` a weight, the scales as stored."""
    return sum(q.size * bits // 8 + s.nbytes for p in layers for q, s in p)


def dequantized(q, scales, zeros=None):
    n, k = q.shape
    g = scales.shape[0]
    w = q.astype(jnp.float32).reshape(n, g, k // g)
    if zeros is not None:
        w = w - zeros.astype(jnp.float32).T[:, :, None]
    w = w * scales.T[:, :, None]
    return w.reshape(n, k)


def chain(matmul):
    """All layers' projections in one program: each projection's output summed into a scalar per layer, so nothing
    is dead and the weights are the bytes that move."""
    @jax.jit
    def run(xs, layers):
        total = jnp.float32(0)
        for projections in layers:
            for x, weight in zip(xs, projections):
                total = total + jnp.sum(matmul(x, weight).astype(jnp.float32))
        return total
    return run


def check(matmul, xs, layers, ref_layers) -> float:
    worst = 0.0
    for x, weight, ref_weight in zip(xs, layers[0], ref_layers[0]):
        got = np.asarray(jax.jit(matmul)(x, weight), np.float32)
        ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantized(*ref_weight).T,
                                 precision=jax.lax.Precision.HIGHEST))
        worst = max(worst, float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30)))
    return worst


def w4a16_peer():
    from pallas_kernels.w4a16 import w4a16_matmul

    def prepare(q, scales):
        u = (np.asarray(q.astype(jnp.int8), np.int64) + 8).T  # [K, N] unsigned nibbles
        k, n = u.shape
        words = np.zeros((k // 8, n), np.uint32)
        for j in range(8):
            words |= (u[j::8].astype(np.uint32) << (4 * j))
        zeros = np.full(scales.shape, 8.0, np.float32)
        return jnp.asarray(words.view(np.int32)), jnp.asarray(zeros, jnp.bfloat16), scales.astype(jnp.bfloat16)

    def matmul(x, weight):
        packed, zeros, scales = weight
        return w4a16_matmul(x, packed, zeros, scales, group=GROUP)
    return prepare, matmul


def time_side(name, matmul, xs, layers, record, rows, floor_bytes, copy_rate, bf16_s=None, ref_layers=None,
              config=None):
    try:
        t0 = time.perf_counter()
        err = check(matmul, xs, layers, ref_layers or layers)
        if not err < MAX_REL_ERROR:
            raise AssertionError(f"max relative error {err:.3g}")
        seconds = common.timeit(chain(matmul), xs, layers, runs=5)
        entry = dict(seconds=seconds, max_rel_error=err, vs_floor=seconds / (floor_bytes / copy_rate),
                     bytes_per_s=floor_bytes / seconds, compile_and_check_s=time.perf_counter() - t0)
        if bf16_s:
            entry["bf16_over_this"] = bf16_s / seconds
        if config is not None:
            entry["config"] = dataclasses.asdict(config)
    except Exception as e:  # a failing candidate is reported, the others go on
        entry = dict(error=f"{type(e).__name__}: {str(e)[:800]}")
    record.setdefault(str(rows), {})[name] = entry
    log(rows, name, {k: (round(v, 6) if isinstance(v, float) else v) for k, v in entry.items()})
    return entry.get("seconds")


def fastest(configs, deadline: float, seconds_of) -> dict:
    """The fastest of `configs` timed by `seconds_of(cfg)` (None where it failed) while `deadline` (perf_counter)
    allows: {seconds, config}, or {} when none ran."""
    best = {}
    for cfg in configs:
        if time.perf_counter() > deadline:
            break
        seconds = seconds_of(cfg)
        if seconds and seconds < best.get("seconds", float("inf")):
            best = dict(seconds=seconds, config=dataclasses.asdict(cfg))
    return best


def kernel_runner(interpret: bool):
    """The kernel at exactly a candidate's configuration; `interpret`: in Mosaic GPU's interpreter (its
    shared-memory form, a few programs)."""
    if not interpret:
        return lambda x, w, cfg: weight_only_matmul(x, *w, config=cfg)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return lambda x, w, cfg: weight_only_matmul(x, *w, config=dataclasses.replace(cfg, staged=True, min_programs=4),
                                                interpret=plgpu.InterpretGPUParams())


def candidate(tile_n: int, block_k: int, steps: int, programs: int, resident_x: bool = False,
              one_accumulator: bool = False, warp_specialized: bool = False, persistent: int = 0) -> WeightOnlyConfig:
    return WeightOnlyConfig(tile_n=tile_n, block_k=block_k, max_concurrent_steps=steps, min_programs=programs,
                            resident_x=resident_x, one_accumulator=one_accumulator,
                            warp_specialized=warp_specialized, persistent=persistent)


def candidate_list(text: str) -> tuple[tuple[int, ...], ...]:
    """`--candidates`: semicolon-separated tuples of `candidate`'s arguments (booleans as 0 / 1)."""
    return tuple(tuple(int(v) for v in item.split(",")) for item in text.split(";") if item.strip())


def label(cfg: WeightOnlyConfig) -> str:
    resident = " rx" if cfg.resident_x else ""
    one = " 1acc" if cfg.one_accumulator else ""
    ws = " ws" if cfg.warp_specialized else ""
    persistent = f" persistent{cfg.persistent}" if cfg.persistent else ""
    return (f"ours n{cfg.tile_n} k{cfg.block_k} c{cfg.max_concurrent_steps} p{cfg.min_programs}{resident}{one}{ws}"
            f"{persistent}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--git-sha", default="")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--deadline-s", type=float, default=300)
    ap.add_argument("--tiny", action="store_true", help="small shapes in Mosaic's interpreter (a CPU check)")
    ap.add_argument("--trace", action="store_true",
                    help="with --per-shape: a profiler trace of each shape's chain (bf16; int4 shipped and persistent, "
                         "with --loads-only also both emptied): device busy time, kernel durations and launch lag "
                         "per call, beside its wall time (host- or device-bound)")
    ap.add_argument("--per-shape-s", type=float, default=120,
                    help="seconds past --deadline-s for --per-shape's candidates")
    ap.add_argument("--loads-only", type=int, default=0, metavar="N",
                    help="also the first N one-row int4 candidates with no upcast or product (the pipeline's copies "
                         "alone, output wrong): the rate the kernel's structure streams at, beside its own")
    ap.add_argument("--candidates", type=candidate_list, default=None, metavar="N,K,C,P[,RX,1ACC,WS,PERSISTENT];...",
                    help="the int4 candidates at every --rows (and --loads-only's, --per-shape's) instead of the "
                         "built-in lists, e.g. '64,256,8,528;64,256,16,0' (the tuples `candidate` takes)")
    ap.add_argument("--skip-8bit", action="store_true", help="int4 alone (no int8 / float8 sides)")
    ap.add_argument("--per-shape", action="store_true",
                    help="also each projection's shape alone at one row (default configs): its own bytes per second, "
                         "so a fixed cost per launch shows beside the streaming rate")
    args = ap.parse_args()
    if args.tiny:
        args.layers, args.rows = 1, "1"
    shapes = TINY_SHAPES if args.tiny else SHAPES
    ours = kernel_runner(args.tiny)
    _, copy_rate = common.copy_bandwidth(1 << 20 if args.tiny else 1 << 30)
    log("copy", copy_rate / 1e12, "TB/s")
    result = dict(device=common.jax_device_name(), git_sha=args.git_sha, copy_bytes_per_s=copy_rate, int4={},
                  int8={}, fp8={}, bf16={})
    rng = np.random.default_rng(1)
    bf16_layers = [[jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.bfloat16) for k, n in shapes]
                   for _ in range(args.layers)]
    bf16_bytes = sum(w.nbytes for p in bf16_layers for w in p)
    int4 = make_layers(args.layers, jnp.int4, 2, shapes)
    int8 = make_layers(args.layers, jnp.int8, 3, shapes)
    fp8 = make_layers(args.layers, jnp.float8_e4m3fn, 5, shapes)
    int4_bytes, int8_bytes = weight_bytes(int4, 4), weight_bytes(int8, 8)  # float8's bytes are int8's
    prepare4, w4a16 = w4a16_peer()
    int4_triton = [[prepare4(*w) for w in p] for p in int4]
    zrng = np.random.default_rng(4)
    int4z = [[(q, s, jnp.asarray(zrng.integers(-8, 8, s.shape), jnp.bfloat16)) for q, s in p] for p in int4]
    start = time.perf_counter()  # the deadlines count from the first timing, not the host building the layers

    for rows in [int(r) for r in args.rows.split(",") if r]:  # --rows "": --per-shape alone
        xs = [jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16) for k, _ in shapes]
        bf16_s = None
        try:
            bf16_s = common.timeit(chain(lambda x, w: x @ w), xs, bf16_layers, runs=5)
            result["bf16"][str(rows)] = dict(seconds=bf16_s, vs_floor=bf16_s / (bf16_bytes / copy_rate))
            log(rows, "bf16", result["bf16"][str(rows)])
        except Exception as e:
            log(rows, "bf16 failed", e)
        deadline = start + args.deadline_s
        cuts = args.candidates or (INT4_DECODE if rows == 1 else INT4_BATCH)
        best = fastest([candidate(*c) for c in cuts], deadline,
                       lambda cfg: time_side(label(cfg), lambda x, w: ours(x, w, cfg), xs, int4, result["int4"], rows,
                                             int4_bytes, copy_rate, bf16_s, config=cfg))
        result.setdefault("best", {}).setdefault("int4", {})[str(rows)] = best
        cfg = WeightOnlyConfig(**best["config"]) if best else WeightOnlyConfig()
        time_side(label(cfg) + " zero points", lambda x, w: ours(x, w, cfg), xs, int4z,
                  result["int4"], rows, int4_bytes, copy_rate, bf16_s, config=cfg)
        time_side("triton w4a16", w4a16, xs, int4_triton, result["int4"], rows, int4_bytes, copy_rate, bf16_s,
                  ref_layers=int4)
        for kind, layers in () if args.skip_8bit else (("int8", int8), ("fp8", fp8)):
            best = fastest([candidate(*c) for c in INT8], deadline,
                           lambda cfg, kind=kind, layers=layers: time_side(
                               label(cfg), lambda x, w: ours(x, w, cfg), xs, layers, result[kind], rows, int8_bytes,
                               copy_rate, bf16_s, config=cfg))
            result.setdefault("best", {}).setdefault(kind, {})[str(rows)] = best
            time_side("xla upcast dot", lambda x, w: (jnp.dot(x, w[0].astype(x.dtype).T,
                                                              preferred_element_type=jnp.float32) * w[1][0]).astype(
                x.dtype), xs, layers, result[kind], rows, int8_bytes, copy_rate, bf16_s)
        write(args.out, result)
    if args.loads_only:
        decode = args.candidates or INT4_DECODE
        result["loads_only"] = loads_only(ours, [candidate(*c) for c in decode[:args.loads_only]], shapes, rng,
                                          int4, int4_bytes, copy_rate)
        write(args.out, result)
    if args.per_shape:
        result["per_shape"] = per_shape(shapes, rng, bf16_layers, int4, int8, ours, copy_rate, args.trace,
                                        deadline=start + args.deadline_s + args.per_shape_s,
                                        trace_emptied=args.loads_only > 0,
                                        candidates=args.candidates or PER_SHAPE_INT4)
        write(args.out, result)
    log("done in", time.perf_counter() - start)


def write(path: str, result: dict) -> None:
    """The results so far (each part rewrites the file, so a call's limit keeps what ran)."""
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def loads_only(ours, configs, shapes, rng, int4, int4_bytes, copy_rate) -> dict:
    """One row through each config's pipeline with the step bodies' upcast and products removed (the copies and
    barriers alone): whether the kernel's structure, not its arithmetic, holds the rate."""
    xs = [jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16) for k, _ in shapes]
    out = {}
    with arithmetic_removed():
        for cfg in configs:
            try:
                seconds = common.timeit(chain(lambda x, w, cfg=cfg: ours(x, w, cfg)), xs, int4, runs=5)
                out[label(cfg)] = dict(seconds=seconds, bytes_per_s=int4_bytes / seconds,
                                       vs_copy=int4_bytes / seconds / copy_rate)
            except Exception as e:
                out[label(cfg)] = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
            log("loads only", label(cfg), out[label(cfg)])
    return out


@contextlib.contextmanager
def arithmetic_removed():
    """The kernel's per-chunk step bodies emptied (their output wrong) while inside: its copies and barriers alone.
    The compiled kernels are dropped on the way in and out, so neither form is served from the other's cache."""
    from pallas_kernels.weight_only import kernel

    real = kernel._Tiles.add_scaled_chunks
    try:
        kernel._Tiles.add_scaled_chunks = lambda self, total, *_, **__: total
        jax.clear_caches()
        yield
    finally:
        kernel._Tiles.add_scaled_chunks = real
        jax.clear_caches()


def per_shape(shapes, rng, bf16_layers, int4, int8, ours, copy_rate, trace: bool = False,
              deadline: float = float("inf"), trace_emptied: bool = False, candidates=PER_SHAPE_INT4) -> dict:
    """Each projection shape alone (every layer's weight of that shape in one jit), one row: int8 at its default
    config, int4 at its default then `candidates` while `deadline` (perf_counter) allows, the fastest under
    `best`."""
    out = {}
    if trace:
        out["traces"] = per_shape_traces(shapes, rng, bf16_layers, int4, ours, emptied=trace_emptied)
    for i, (k, n) in enumerate(shapes):
        record = {}
        xs = [jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)]
        pick = lambda layers: [[p[i]] for p in layers]
        bf16 = pick(bf16_layers)
        bf16_s = common.timeit(chain(lambda x, w: x @ w), xs, bf16, runs=5)
        record["bf16"] = dict(seconds=bf16_s, bytes_per_s=sum(p[0].nbytes for p in bf16) / bf16_s)
        chosen = pick(int8)
        time_side("int8", lambda x, w: ours(x, w, default_config(1)), xs, chosen, record, 1, weight_bytes(chosen, 8),
                  copy_rate, bf16_s)
        chosen = pick(int4)
        nbytes = weight_bytes(chosen, 4)
        # the shipped configuration first (once, if a candidate repeats it), then the candidates
        record["best"] = fastest(dict.fromkeys([default_config(1)] + [candidate(*c) for c in candidates]),
                                 deadline, lambda cfg: time_side(label(cfg), lambda x, w: ours(x, w, cfg), xs, chosen,
                                                                 record, 1, nbytes, copy_rate, bf16_s, config=cfg))
        out[f"{k}x{n}"] = record
    return out


def per_shape_traces(shapes, rng, bf16_layers, int4, ours, calls: int = 20, emptied: bool = False) -> dict:
    """Per shape and side (bf16; int4 shipped and persistent over the SMs; with `emptied`, both int4 forms again with
    their arithmetic removed), `calls` back-to-back calls of the chain under the profiler: wall time, device busy
    time and kernels per call (each kernel's own device time), launch lag (host-bound launches show lags near the
    launch latency)."""
    sms = getattr(jax.devices()[0], "core_count", 0) or 4  # the interpreter's devices report none
    persistent = dataclasses.replace(default_config(1), persistent=sms, min_programs=0)
    int4_sides = (("int4", default_config(1)), ("int4 persistent", persistent))
    out = {}
    for i, (k, n) in enumerate(shapes):
        xs = [jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)]
        sides = [("bf16", bf16_layers, lambda x, w: x @ w)]
        sides += [(side, int4, lambda x, w, cfg=cfg: ours(x, w, cfg)) for side, cfg in int4_sides]
        for side, layers, matmul in sides:
            out[f"{k}x{n} {side}"] = traced_chain(matmul, xs, [[p[i]] for p in layers], calls)
            log(f"{k}x{n} {side}", out[f"{k}x{n} {side}"])
        if emptied:
            with arithmetic_removed():
                for side, cfg in int4_sides:
                    out[f"{k}x{n} {side} emptied"] = traced_chain(lambda x, w, cfg=cfg: ours(x, w, cfg), xs,
                                                                  [[p[i]] for p in int4], calls)
                    log(f"{k}x{n} {side} emptied", out[f"{k}x{n} {side} emptied"])
    return out


def traced_chain(matmul, xs, layers, calls: int) -> dict:
    import tempfile
    from pathlib import Path

    from probe_layer_loop_gpu import gpu_events, gpu_idle, kernel_summary, launch_lag

    run = chain(matmul)
    jax.block_until_ready(run(xs, layers))
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d):
            for _ in range(calls):
                total = run(xs, layers)
            jax.block_until_ready(total)
        wall = time.perf_counter() - t0
        events = gpu_events(Path(d))
        return dict(wall_us_per_call_traced=wall / calls * 1e6,
                    busy_us_per_call=sum(e["dur"] for e in events) / calls,
                    kernels_per_call=len(events) / calls, idle=gpu_idle(Path(d), gap_us=5.0),
                    launch=launch_lag(Path(d)),
                    kernels=[(name, round(ms * 1e3 / calls, 2), count / calls)
                             for name, ms, count in kernel_summary(Path(d), top=8)])


if __name__ == "__main__":
    main()
