"""GPU probe: what a loop over stacked layer weights costs a memory-bound decode step, and where the step's time goes.

Part `loop`: Llama-3-8B-shaped projections (q/k/v, o, gate/up, down) for `--layers` layers, run on a batch of 1 and
64 tokens four ways: `lax.scan` over stacked weights, the same scan fully unrolled, a Python loop over one array per
layer, and the scan with XLA's dynamic-slice fusion flag (in its own process, as flags are read once). Each reports
its step time, its compile time, the weight bytes ÷ copy bandwidth floor, and how many copy / dynamic-slice
instructions the compiled program holds (a slice copied out of the stack before each matmul triples the bytes).

Part `engine`: the engine's jitted decode step at batch 1 on a random-weight Llama with Llama-3-8B layers (fewer of
them, tiny vocabulary), with a profiler trace summarised by kernel name; `--engine-model qwen3-30b-a3b` (any shape
of `moe_shapes.py`) profiles that MoE shape instead, `llama-3.1-8b` the whole dense shape (its 128k-token LM head
and sampler), weights made on the device: the device step beside the
engine's step period says whether a decode step waits on the host or on its kernels, the summary which kernels.

    PYTHONPATH=. python scripts/probe_layer_loop_gpu.py --out $OUT/probe.json
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench_common import copy_bandwidth, log, median, timeit  # noqa: E402

D, F, QKV, O = 4096, 14336, 6144, 4096
DSF_FLAG = "--xla_gpu_enable_dynamic_slice_fusion=true"


def stacked_weights(layers: int):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 4)
    shapes = {"qkv": (layers, D, QKV), "o": (layers, O, D), "gate_up": (layers, D, 2 * F), "down": (layers, F, D)}
    return {name: (jax.random.normal(k, s, jnp.bfloat16) * 0.02) for k, (name, s) in zip(keys, shapes.items())}


def layer(x, w):
    import jax
    import jax.numpy as jnp

    qkv = x @ w["qkv"]
    x = x + qkv[:, :O] @ w["o"]
    gu = x @ w["gate_up"]
    x = x + (jax.nn.silu(gu[:, :F]) * gu[:, F:]) @ w["down"]
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)).astype(x.dtype)


def variants(layers: int):
    import jax

    def scan(unroll):
        def run(x, w):
            return jax.lax.scan(lambda h, wl: (layer(h, wl), None), x, w, unroll=unroll)[0]
        return run

    def python_loop(x, ws):
        for w in ws:
            x = layer(x, w)
        return x

    return {"scan": (scan(1), False), "scan_unrolled": (scan(layers), False), "python_loop": (python_loop, True)}


def hlo_counts(text: str) -> dict[str, int]:
    lines = [ln for ln in text.splitlines() if "=" in ln]
    return {op: sum(f" {op}(" in ln for ln in lines) for op in ("copy", "dynamic-slice", "while", "custom-call")}


def loop_part(layers: int, only: str | None) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    stacked = stacked_weights(layers)
    weight_bytes = sum(a.nbytes for a in stacked.values())
    _, bandwidth = copy_bandwidth()
    out: dict[str, Any] = {"layers": layers, "weight_bytes": weight_bytes, "copy_bytes_per_s": bandwidth,
                           "floor_ms": weight_bytes / bandwidth * 1e3}  # as the e2e floor: bytes ÷ copy rate
    per_layer = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(layers)]
    for name, (fn, unstacked) in variants(layers).items():
        if only and name != only:
            continue
        w = per_layer if unstacked else stacked
        for batch in (1, 64):
            x = jax.random.normal(jax.random.key(batch), (batch, D), jnp.bfloat16)
            start = time.perf_counter()
            compiled = jax.jit(fn).lower(x, w).compile()
            compile_s = time.perf_counter() - start
            seconds = timeit(compiled, x, w)
            out[f"{name}_b{batch}"] = {"ms": seconds * 1e3, "compile_s": compile_s,
                                       "vs_floor": seconds * 1e3 / out["floor_ms"],
                                       "hlo": hlo_counts(compiled.as_text())}
            log(name, batch, out[f"{name}_b{batch}"])
    return out


def dsf_part(layers: int) -> dict[str, Any]:
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + DSF_FLAG).strip())
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        proc = subprocess.run([sys.executable, __file__, "--part", "loop", "--layers", str(layers), "--only", "scan",
                               "--out", f.name], env=env, capture_output=True, text=True)
        if proc.returncode:
            return {"error": proc.stderr[-2000:]}
        return json.loads(Path(f.name).read_text())


def trace_events(trace_dir: Path) -> list[dict[str, Any]]:
    """Every event of the profiler trace written under `trace_dir` (none if it wrote no trace)."""
    files = sorted(trace_dir.rglob("*.trace.json.gz")) or sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        return []
    events = json.loads(gzip.decompress(files[-1].read_bytes()))
    return events["traceEvents"] if isinstance(events, dict) else events


def gpu_pids(events: list[dict[str, Any]]) -> set[Any]:
    """The trace's GPU processes (their streams' events are the device's)."""
    return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and "/device:GPU" in e.get("args", {}).get("name", "")}


def gpu_events(trace_dir: Path) -> list[dict[str, Any]]:
    """The trace's GPU kernel and copy events (device events carry a 'stream' pid), in start order."""
    events = trace_events(trace_dir)
    on_gpu = gpu_pids(events)
    return sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in on_gpu and "dur" in e),
                  key=lambda e: e["ts"])


def kernel_totals(trace_dir: Path) -> dict[str, list[float]]:
    """name: [total ms, count] of the trace's GPU kernels."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in gpu_events(trace_dir):
        totals[e["name"]][0] += e["dur"] / 1e3
        totals[e["name"]][1] += 1
    return totals


def gpu_gaps(events: list[dict[str, Any]]) -> list[float]:
    """µs the GPU sat idle between consecutive events (`gpu_events`, in start order), each gap once."""
    gaps, end = [], None
    for e in events:
        if end is not None and e["ts"] > end:
            gaps.append(e["ts"] - end)
        end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
    return gaps


def gpu_idle(trace_dir: Path, gap_us: float = 20.0) -> dict[str, float]:
    """How busy the GPU was from its first event to its last: the span, the time inside events, and the gaps
    between events longer than `gap_us` (a device waiting on the host shows as such gaps, once per step)."""
    events = gpu_events(trace_dir)
    if not events:
        return {}
    gaps = [g for g in gpu_gaps(events) if g > gap_us]
    end = max(e["ts"] + e["dur"] for e in events)
    return {"span_ms": (end - events[0]["ts"]) / 1e3, "busy_ms": sum(e["dur"] for e in events) / 1e3,
            "long_gaps": len(gaps), "long_gaps_ms": sum(gaps) / 1e3, "max_gap_ms": max(gaps, default=0.0) / 1e3}


def kernel_summary(trace_dir: Path, top: int = 40, minus: Path | None = None) -> list[tuple[str, float, int]]:
    """(name, total ms, count) of the trace's GPU kernels, largest first; less those of the trace `minus` (a run
    of the same request that stops after its prefill, so the difference is the decode steps alone)."""
    totals = kernel_totals(trace_dir)
    for name, (t, c) in (kernel_totals(minus) if minus else {}).items():
        totals[name] = [totals.get(name, [0.0, 0])[0] - t, totals.get(name, [0.0, 0])[1] - c]
    return sorted(((n, round(t, 3), c) for n, (t, c) in totals.items() if c), key=lambda r: -r[1])[:top]


def host_timeline(trace_dir: Path) -> dict[str, float]:
    """Where the host's time per engine step goes, from the profiler's Python events: medians (ms) of the runner's
    `dispatch` (preparing and launching a step: long if a launch waits, e.g. on a donated buffer still in use) and
    `fetch` (waiting for a step's outputs: near zero when the host is the bottleneck), the host's work between a
    fetch and the next dispatch, and PjRt's waits on buffer holds inside dispatches."""
    events = [e for e in trace_events(trace_dir) if e.get("ph") == "X"]
    if not events:
        return {}

    def calls(suffix: str) -> list[dict[str, Any]]:
        return sorted((e for e in events if e["name"].startswith("$runner.py:") and e["name"].endswith(suffix)),
                      key=lambda e: e["ts"])

    dispatches, fetches = calls(" dispatch"), calls(" fetch")
    between = [d["ts"] - (f["ts"] + f["dur"]) for f, d in zip(fetches, dispatches[2:])]
    holds = [e["dur"] for e in events if e["name"] in ("Wait for donation holds", "Wait for usage holds")]
    return {"steps": len(dispatches), "dispatch_ms": median([e["dur"] for e in dispatches]) / 1e3,
            "fetch_ms": median([e["dur"] for e in fetches]) / 1e3, "fetch_to_next_dispatch_ms": median(between) / 1e3,
            "holds_ms_per_step": sum(holds) / 1e3 / max(len(dispatches), 1), "max_hold_ms": max(holds, default=0) / 1e3}


def launch_lag(trace_dir: Path, near_us: float = 20.0) -> dict[str, float]:
    """Whether the host's kernel launches or the GPU set the pace: each GPU event is matched to the host API call
    that launched it (CUPTI's correlation id), and its lag is the time from that call's start to the event's start.
    Lags near the launch latency (under `near_us`) for most kernels: the GPU ran each kernel as soon as the host
    launched it, so the launches set the pace; lags that grow along the step: a queue of launched work, the GPU
    sets the pace. Also the launch calls' count and median host time."""
    every = trace_events(trace_dir)
    events, on_gpu = [e for e in every if e.get("ph") == "X" and "dur" in e], gpu_pids(every)
    launches = {e["args"]["correlation_id"]: e for e in events if e["pid"] not in on_gpu
                and "launch" in e["name"].lower() and "correlation_id" in e.get("args", {})}
    lags = [e["ts"] - launches[e["args"]["correlation_id"]]["ts"] for e in events if e["pid"] in on_gpu
            and e.get("args", {}).get("correlation_id") in launches]
    if not lags:
        return {"matched": 0, "launch_calls": len(launches)}
    return {"matched": len(lags), "launch_calls": len(launches),
            "launch_call_us_median": median([e["dur"] for e in launches.values()]),
            "lag_us_median": median(lags), "lag_us_p90": sorted(lags)[int(0.9 * (len(lags) - 1))],
            "fraction_lag_under_near": sum(lag < near_us for lag in lags) / len(lags)}


def fusion_sources(dump_dir: Path, kernels: list[str], marker: str = "ragged_paged_attention_decode",
                   chars: int = 1500) -> dict[str, str]:
    """The optimized HLO behind each XLA kernel name (`fusion_553` is instruction `%fusion.553`), from an
    `XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text` dump, in the modules that hold `marker` (the decode
    step's): the instruction's line, then the start of the computation it calls."""
    import re

    texts = [f.read_text() for f in sorted(dump_dir.glob("*after_optimizations.txt"))]
    texts = [t for t in texts if marker in t]
    found: dict[str, str] = {}
    for kernel in kernels:
        head, _, tail = kernel.rpartition("_")
        candidates = [kernel] + ([f"{head}.{tail}"] if tail.isdigit() else [])
        for text in texts:
            match = next((m for c in candidates if (m := re.search(rf"\n\s*(?:ROOT )?%{re.escape(c)} = [^\n]*",
                                                                    text))), None)
            if match is None:
                continue
            line = match.group(0).strip()
            called = re.search(r"calls=(%[\w.\-]+)", line)
            body = called and re.search(rf"\n{re.escape(called.group(1))} [^\n]*\{{(.*?)\n\}}", text, re.S)
            found[kernel] = (line[:400] + "\n" + (body.group(1) if body else ""))[:chars]
            break
    return found


def copy_sources(dump_dir: Path, marker: str = "ragged_paged_attention_decode", limit: int = 30) -> list[list]:
    """The `copy` instructions of the decode step's optimized HLO (those whose layouts match run as device-to-device
    memcpys, CUPTI's `memcpy32_post`; the others as fusions), grouped by shape and the op that made them:
    [shape, op_name, count], most frequent first."""
    import collections
    import re

    counts: collections.Counter = collections.Counter()
    for f in sorted(dump_dir.glob("*after_optimizations.txt")):
        text = f.read_text()
        if marker not in text:
            continue
        for m in re.finditer(r"= (\S+) copy\([^\n]*", text):
            op = re.search(r'op_name="([^"]*)"', m.group(0))
            counts[(m.group(1), op.group(1) if op else "")] += 1
    return [[shape, op, n] for (shape, op), n in counts.most_common(limit)]


def engine_variant(name: str):
    """The engine as `bench_moe.py`'s A/B contexts leave it ('': unchanged; `a+b`: both), profiled in the same
    call."""
    import contextlib

    import bench_moe

    stack = contextlib.ExitStack()
    for part in filter(None, name.split("+")):
        if part.startswith("tiles_"):
            stack.enter_context(bench_moe.decode_tiles(**bench_moe.DECODE_TILES[part.removeprefix("tiles_")]))
        else:
            stack.enter_context(bench_moe.ENGINE_VARIANTS[part]())
    return bench_moe.retraced(stack)


def timed_runner_calls(runner) -> dict[str, list[float]]:
    """Wraps the runner's `dispatch` and `fetch` to record each call's wall seconds (no profiler running: its
    Python tracing inflates the host's share)."""
    times: dict[str, list[float]] = {"dispatch": [], "fetch": []}
    for name in times:
        def timed(*args, _call=getattr(runner, name), _into=times[name], **kwargs):
            start = time.perf_counter()
            result = _call(*args, **kwargs)
            _into.append(time.perf_counter() - start)
            return result
        setattr(runner, name, timed)
    return times


def dense_8b_dir(out: Path, layers: int) -> Path:
    """A Llama-3.1-8B-shaped model directory (config.json and a tokenizer of its vocabulary; no weights)."""
    from e2e_checkpoint import LLAMA_31_8B, llama_config, write_tokenizer

    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({**llama_config(LLAMA_31_8B), "num_hidden_layers": layers}))
    write_tokenizer(out, LLAMA_31_8B["vocab_size"])
    return out


def engine_part(layers: int, steps: int, shape: str = "llama", batch: int = 1) -> dict[str, Any]:
    import jax

    from check_pipeline_gpu import LLAMA3_8B_LAYER, Recorder, device_seconds
    from jengine import LLM, SamplingParams
    from jengine.models.demo import build_random_llama

    extra: dict[str, Any] = {}
    if shape == "llama":
        model = build_random_llama(Path(tempfile.mkdtemp()) / "llama", num_hidden_layers=layers, **LLAMA3_8B_LAYER)
    elif shape == "llama-3.1-8b":  # the whole shape, its 128k-token LM head and sampler included
        model = dense_8b_dir(Path(tempfile.mkdtemp()) / shape, layers)
        extra = dict(load_format="dummy")
    else:
        from moe_shapes import write_shape

        model = write_shape(shape, Path(tempfile.mkdtemp()) / shape, num_layers=layers)
        extra = dict(load_format="dummy")
    out: dict[str, Any] = {"layers": layers, "shape": shape, "batch": batch}
    start = time.perf_counter()
    with LLM(str(model), dtype="bfloat16", max_model_len=1024, max_num_seqs=max(8, batch), enable_prefix_caching=False,
             seed=0, num_gpu_blocks_override=4096, **extra) as llm:
        out["engine_start_s"] = time.perf_counter() - start
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        prompt = [{"prompt_token_ids": [3 + (i + j) % 400 for j in range(128)]} for i in range(batch)]
        llm.generate(prompt, params, use_tqdm=False)
        run_step = llm._core.runner._step
        recorder = Recorder(llm, batch)
        host_calls = timed_runner_calls(llm._core.runner)
        llm.generate(prompt, params, use_tqdm=False)
        out["host_ms_unprofiled"] = {name: median(times) * 1e3 for name, times in host_calls.items()}
        out["device_step_ms"] = device_seconds(llm, recorder, run_step) * 1e3
        out["step_period_ms"] = median(recorder.decode_periods(batch)) * 1e3
        traces = {}
        for new_tokens in (1, 9):  # the prefill alone, then it and 8 decode steps: their difference is the decode
            traces[new_tokens] = Path(tempfile.mkdtemp())
            with jax.profiler.trace(str(traces[new_tokens])):
                llm.generate(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                             use_tqdm=False)
        out["kernels_8_steps"] = kernel_summary(traces[9], minus=traces[1])
        out["gpu_idle_9_tokens"] = gpu_idle(traces[9])
        out["host_9_tokens"] = host_timeline(traces[9])
        out["launch_lag_9_tokens"] = launch_lag(traces[9])
    log(json.dumps(out, indent=1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--part", action="append", choices=["loop", "dsf", "engine"])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--engine-layers", type=int, default=8)
    parser.add_argument("--engine-model", default="llama", help="llama (8B layers, tiny vocabulary), llama-3.1-8b "
                        "(the whole shape: its vocabulary, dummy weights), or a shape of moe_shapes.py")
    parser.add_argument("--engine-batch", type=int, nargs="+", default=[1], help="decode batches profiled")
    parser.add_argument("--only", default=None)
    parser.add_argument("--engine-variant", nargs="*", default=[""], help="engine: profile the engine as each of "
                        "bench_moe.py's A/B contexts leaves it (listed, xla_router, xla_combine, merged_attention, "
                        "tiles_<NAME>; a+b: both; '': the default)")
    parser.add_argument("--hlo-dump", type=Path, help="engine: the XLA dump directory (XLA_FLAGS=--xla_dump_to=DIR "
                        "--xla_dump_hlo_as_text) to read the profiled fusions' HLO from")
    args = parser.parse_args()
    result: dict[str, Any] = {}
    for part in args.part or ["loop", "dsf", "engine"]:
        try:
            if part == "loop":
                result["loop"] = loop_part(args.layers, args.only)
            elif part == "dsf":
                result["dsf"] = dsf_part(args.layers)
            else:
                for batch, variant in ((b, v) for b in args.engine_batch for v in args.engine_variant):
                    key = ("engine" if batch == 1 else f"engine_b{batch}") + (f"_{variant}" if variant else "")
                    with engine_variant(variant):
                        result[key] = engine_part(args.engine_layers, 32, args.engine_model, batch)
                    if args.hlo_dump:
                        names = [n for n, _, _ in result[key]["kernels_8_steps"]]
                        result[key]["fusion_hlo"] = fusion_sources(args.hlo_dump, names)
                        result[key]["copies"] = copy_sources(args.hlo_dump)
                    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        except Exception as e:  # one part failing must not lose the others
            result[part] = {"error": repr(e)}
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    if args.only:  # the child process of the dsf part: its own numbers only
        Path(args.out).write_text(json.dumps(result["loop"], default=str))


if __name__ == "__main__":
    main()
