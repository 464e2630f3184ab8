"""Probe: where a prefix-cached request's TTFT goes on the host. A Llama-3.1-8B-shaped engine (dummy weights, made on
the device) serves a 2,048-token shared prompt plus a 64-token suffix, one request at a time, as `bench_e2e.py
--part engine` measures TTFT; the same requests then run under cProfile, whose table (by own time and by cumulative
time) says which host functions stand between the device's step and the first token.

    PYTHONPATH=. python scripts/probe_ttft_host_gpu.py --out $OUT/ttft-host.txt [--timeline] [--device-trace]
    PYTHONPATH=. python scripts/probe_ttft_host_gpu.py --tiny --timeline --out /tmp/ttft.txt   # CPU: paths only
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from e2e_checkpoint import LLAMA_31_8B, TINY, llama_config, write_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--system-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--tiny", action="store_true", help="a small Llama, 128 + 8 tokens: the paths on a CPU")
    parser.add_argument("--timeline", action="store_true", help="the requests' moments, then launch-to-ready")
    parser.add_argument("--device-trace", action="store_true",
                        help="also profile the hits on the device: kernels by total time, and the GPU's idle gaps")
    parser.add_argument("--also-nondeterministic", action="store_true",
                        help="then the same requests' TTFT in an engine with deterministic=False (no profile)")
    args = parser.parse_args()
    from jengine import LLM, SamplingParams

    shape = TINY if args.tiny else LLAMA_31_8B
    if args.tiny:
        args.system_len, args.suffix_len, args.requests = 128, 8, 3
    model = Path(tempfile.mkdtemp()) / "llama-dummy"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(llama_config(shape)))
    write_tokenizer(model, shape["vocab_size"])
    options = dict(load_format="dummy", dtype="bfloat16", max_model_len=min(4096, shape["max_position_embeddings"]),
                   max_num_seqs=256, max_num_batched_tokens=2048, num_gpu_blocks_override=8192,
                   enable_prefix_caching=True)
    llm = LLM(str(model), **options)
    rng = np.random.default_rng(0)
    low, high = (3, shape["vocab_size"]) if args.tiny else (1000, 100_000)
    system = rng.integers(low, high, args.system_len).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def one() -> float:
        suffix = rng.integers(low, high, args.suffix_len).tolist()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": system + suffix}], greedy, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(4):  # compiles and fills the prefix cache
        one()
    plain = [one() * 1e3 for _ in range(args.requests)]
    timeline = moments(llm, one, args.requests) if args.timeline else ""
    timeline += device_trace(one, args.requests) if args.device_trace else ""
    profile = cProfile.Profile()
    profile.enable()
    profiled = [one() * 1e3 for _ in range(args.requests)]
    profile.disable()
    text = io.StringIO()
    text.write(f"TTFT ms plain: {np.round(plain, 2).tolist()}\nmedian {np.median(plain):.2f}\n")
    text.write(f"TTFT ms under cProfile: median {np.median(profiled):.2f}\n{timeline}")
    for key in ("tottime", "cumulative"):
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(40)
    llm.shutdown()
    if args.also_nondeterministic:
        llm = LLM(str(model), **options, deterministic=False)
        for _ in range(4):
            one()
        free = [one() * 1e3 for _ in range(args.requests)]
        text.write(f"\ndeterministic=False: TTFT ms median {np.median(free):.2f} {np.round(free, 2).tolist()}\n")
        llm.shutdown()
    Path(args.out).write_text(text.getvalue())
    print(text.getvalue()[:3000])


def device_trace(one, requests: int) -> str:
    """The hits' kernels under the profiler: total ms a request by name (largest first), and how long the GPU sat
    idle between its first and last event (the host's launches and fetches then show as gaps)."""
    import jax

    from probe_layer_loop_gpu import gpu_events, gpu_gaps, gpu_idle, kernel_summary

    trace = Path(tempfile.mkdtemp()) / "trace"
    with jax.profiler.trace(str(trace)):
        for _ in range(requests):
            one()
    lines = [f"device trace of {requests} hits: {gpu_idle(trace)}", step_gaps(gpu_gaps(gpu_events(trace)), requests),
             "  ms a request, launches a request, kernel:"]
    lines += [f"  {ms / requests:8.3f} {count / requests:6.1f}  {name[:110]}"
              for name, ms, count in kernel_summary(trace)]
    return "\n".join(lines) + "\n"


def step_gaps(gaps: list[float], requests: int, between_us: float = 1000.0) -> str:
    """The GPU's idle time (`gpu_gaps`, µs) inside the hits' steps (gaps shorter than `between_us`: the device
    waiting on the host's launches within a request) apart from the gaps between requests (the host's work around
    a step)."""
    inside = [g for g in gaps if g < between_us]
    between = [g for g in gaps if g >= between_us]
    return (f"  gaps inside a request's steps: {sum(inside) / 1e3 / requests:.3f} ms a request ({len(inside)} gaps, "
            f"the longest {max(inside, default=0) / 1e3:.3f} ms); between requests: {sum(between) / 1e3:.3f} ms in "
            f"{len(between)} gaps")


def moments(llm, one, requests: int) -> str:
    """Per request, ms since `generate` was called: the forward's launch entered / returned, the sampler's likewise,
    the fetch entered / returned, `generate` returned; then with a wait for the device after the sampler's launch
    (its moment: `ready`)."""
    import jax

    runner = llm._core.runner
    programs, stamps, wait = runner._programs, [], [False]
    forward, sample, fetch = programs.forward, programs.sample, runner.fetch

    def stamped(name, fn, after=None):
        def call(*a, **k):
            stamps.append((f"{name}>", time.perf_counter()))
            out = fn(*a, **k)
            stamps.append((f"{name}<", time.perf_counter()))
            if after is not None and wait[0]:
                after(out)
                stamps.append(("ready", time.perf_counter()))
            return out
        return call

    programs.forward, programs.sample = stamped("forward", forward), stamped("sample", sample, jax.block_until_ready)
    runner.fetch = stamped("fetch", fetch)
    lines = []
    try:
        for waited in (False, True):
            wait[0] = waited
            lines.append(f"timeline ({'waiting for the device after the launches' if waited else 'as served'}):")
            for _ in range(requests):
                stamps.clear()
                start = time.perf_counter()
                one()
                done = time.perf_counter() - start  # on the stamps' clock (`one` times from after its suffix)
                marks = " ".join(f"{n} {(t - start) * 1e3:.2f}" for n, t in stamps)
                lines.append(f"  {marks} | done {done * 1e3:.2f}")
    finally:
        programs.forward, programs.sample, runner.fetch = forward, sample, fetch
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
