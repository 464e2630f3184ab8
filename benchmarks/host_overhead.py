"""Host time per engine step with a fake model, and KV-cache waste on a ShareGPT-like workload.

Times everything the host does in a decode step — schedule, input preparation (persistent batch, padded metadata,
sampling metadata), output handling in the runner, scheduler update, and incremental detokenization — with the jitted
model call replaced by a stub that returns tokens at once. With `--vllm-python`, runs vLLM's own scheduler
benchmark (`shared/bench/vllm_scheduler_bench.py`) in that interpreter in the same run, for the side-by-side ratio.

Then the critical path: the stub becomes a simulated device that runs dispatched steps back to back, `--device-ms`
each, and makes a read of a step's tokens wait until that step is done. The device's idle time before each step is
the host time not hidden behind it (schedule + prepare + process outputs on the critical path), measured for the
pipelined engine (`async_scheduling`, the default) and the serial one. The default device time, 13 ms, is a Llama-3-8B
decode step of 256 requests × 1024 tokens on the H200 from this project's kernel benchmark (32 layers × 0.29 ms of
attention over 256k cached tokens + 16 GB of bf16 weights at 4.2 TB/s).

    python benchmarks/host_overhead.py --vllm-python ~/.cache/vllm-bench/venv/bin/python
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jengine.cache.kv_cache_manager import KVCacheManager  # noqa: E402
from jengine.config import EngineConfig  # noqa: E402
from jengine.engine.core import EngineCore  # noqa: E402
from jengine.factory import build_engine  # noqa: E402
from jengine.request import Request  # noqa: E402
from jengine.runner.step import StepOutput  # noqa: E402
from jengine.sampling.params import SamplingParams  # noqa: E402
from jengine.sampling.sampler import SamplerOutput  # noqa: E402
from jengine.scheduler.scheduler import Scheduler  # noqa: E402
from jengine.config import SchedulerConfig  # noqa: E402
from jengine.tokenizer import IncrementalDetokenizer  # noqa: E402


class SimulatedDevice:
    """Runs dispatched steps back to back, `step_s` each; records how long it sat idle before each step."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.free_at: float | None = None  # when the work queued so far is done
        self.idle: list[float] = []

    def launch(self) -> float:
        """Queue one step; returns when it will be done."""
        now = time.perf_counter()
        if self.free_at is not None:
            self.idle.append(max(0.0, now - self.free_at))
        self.free_at = max(now, self.free_at or now) + self.step_s
        return self.free_at


class DeviceTokens:
    """Sampled tokens on a (simulated) device: the host's read waits until their step is done."""

    def __init__(self, tokens: np.ndarray, ready_at: float) -> None:
        self.tokens, self.ready_at = tokens, ready_at

    def copy_to_host_async(self) -> None:
        pass

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """Sleeps, then spins for the last half millisecond: the wait ends when the step does, not when the OS
        next schedules this thread (which is not host work)."""
        delay = self.ready_at - time.perf_counter()
        if delay > 5e-4:
            time.sleep(delay - 5e-4)
        while time.perf_counter() < self.ready_at:
            pass
        return self.tokens


def fake_step(vocab: int, device: SimulatedDevice | None = None):
    """Stands in for the jitted model step: one token per row, at once or from the simulated device."""
    rng = np.random.default_rng(0)

    def step(params, state, batch):
        tokens = rng.integers(3, vocab, size=len(batch.sample_rows)).astype(np.int32)
        ready_at = device.launch() if device is not None else 0.0
        return state, StepOutput(SamplerOutput(DeviceTokens(tokens, ready_at), None, None, None), None)

    return step


def time_decode_steps(model_dir: str, n: int, prompt_len: int, block_size: int, warmup: int, steps: int, *,
                      async_scheduling: bool = True, device_ms: float | None = None) -> dict:
    """Host ms per decode step (the device answering at once); with `device_ms`, the simulated device's idle ms
    per step (the host's critical path) and the ms per step."""
    max_len = prompt_len + warmup + steps + 80  # room for the decodes that run during the prefill steps
    blocks = n * (-(-max_len // block_size)) + 16
    config = EngineConfig.from_kwargs(model_dir, max_model_len=max_len, max_num_seqs=n, block_size=block_size,
                                      max_num_batched_tokens=8192, num_gpu_blocks_override=blocks,
                                      async_scheduling=async_scheduling)
    parts = build_engine(config)
    core = parts.core
    device = SimulatedDevice(device_ms / 1e3) if device_ms else None
    core.runner._step = fake_step(parts.spec.vocab_size, device)
    rng = np.random.default_rng(1)
    detok = {}
    for i in range(n):
        prompt = rng.integers(3, parts.spec.vocab_size, size=prompt_len).tolist()
        core.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=warmup + steps + 64, ignore_eos=True)))
        detok[f"r{i}"] = IncrementalDetokenizer(parts.tokenizer, prompt_token_ids=prompt)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
        core.step()  # prefill, untimed
    times = []
    for i in range(warmup + steps):
        if i == warmup and device is not None:
            device.idle.clear()
            first = time.perf_counter()
        start = time.perf_counter()
        for out in core.step():
            detok[out.request_id].push(out.new_token_ids)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    assert len(core.scheduler.running) == n
    ms = [t * 1e3 for t in times]
    result = {"median_ms": statistics.median(ms), "p90_ms": float(np.percentile(ms, 90)),
              "mean_ms": statistics.mean(ms)}
    if device is not None:
        idle = [t * 1e3 for t in device.idle]
        result.update(critical_mean_ms=statistics.mean(idle), critical_median_ms=statistics.median(idle),
                      step_ms=(time.perf_counter() - first) * 1e3 / steps)
    return result


def kv_waste(num_requests: int, block_size: int, max_model_len: int, seed: int) -> dict:
    """Scheduler + cache on a ShareGPT-like length mix; waste averaged over steps (fake runner, no model)."""
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(5.5, 1.0, num_requests), 4, 1024).astype(int)
    output_lens = np.clip(rng.lognormal(5.0, 1.0, num_requests), 4, 1024).astype(int)
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_num_queued_reqs=num_requests,
                             max_model_len=max_model_len)
    kv = KVCacheManager(20000, block_size, enable_prefix_caching=True)
    scheduler = Scheduler(config, kv)
    for i, (p, o) in enumerate(zip(prompt_lens, output_lens, strict=True)):
        prompt = rng.integers(3, 30000, size=int(p)).tolist()
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=int(o), ignore_eos=True)))
    fractions, reserved = [], []
    from tests.scheduler.test_scheduler import FakeRunner  # the scheduler tests' fake runner

    runner = FakeRunner()
    while scheduler.has_unfinished():
        sched = scheduler.schedule()
        scheduler.update_from_output(sched, runner.execute(sched))
        running = scheduler.running
        if not running:
            continue
        allocated, unfilled = kv.waste(running)
        fractions.append(unfilled / allocated)
        reserved.append(1 - sum(r.num_tokens for r in running) / (len(running) * max_model_len))
    return {"kv_waste_fraction": statistics.mean(fractions), "kv_waste_fraction_if_reserved": statistics.mean(reserved),
            "steps": len(fractions)}


def run_vllm(python: str, n_values: list[int], prompt_len: int) -> dict:
    bench = ROOT.parent / "shared" / "bench" / "vllm_scheduler_bench.py"
    model = Path(tempfile.gettempdir()) / "vllm-tiny-model"
    if not (model / "config.json").exists():
        subprocess.run([python, str(bench), "--model", str(model), "--make-tiny-model", "--n", "64"], check=True,
                       capture_output=True)
    result = {}
    sched = subprocess.run([python, str(bench), "--model", str(model), "--n", *map(str, n_values), "--sched", "sync",
                            "--prompt-len", str(prompt_len)], capture_output=True, text=True, check=True).stdout
    result["scheduler_raw"] = sched
    for n in n_values:
        runner = subprocess.run([python, str(bench), "--model", str(model), "--runner", "--n", str(n),
                                 "--prompt-len", str(prompt_len)], capture_output=True, text=True, check=True,
                                env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"}).stdout
        result[f"runner_raw_{n}"] = runner
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model dir (default: the built-in demo model)")
    parser.add_argument("--n", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--device-ms", type=float, default=13.0,
                        help="simulated device time per decode step for the critical path (0: skip)")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm==0.33.0")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from jengine.models.demo import ensure_demo_model

    model = args.model or str(ensure_demo_model())
    metrics = {}
    for n in args.n:
        r = time_decode_steps(model, n, args.prompt_len, args.block_size, args.warmup, args.steps)
        metrics[f"host_ms_per_step_{n}"] = r["median_ms"]
        metrics[f"host_ms_per_step_{n}_p90"] = r["p90_ms"]
        print(f"jengine host ms/step at {n} decodes: median {r['median_ms']:.3f}, p90 {r['p90_ms']:.3f}")
    ratios = {}
    for n in args.n if args.device_ms else []:
        for pipelined in (True, False):
            mode = "pipelined" if pipelined else "serial"
            r = time_decode_steps(model, n, args.prompt_len, args.block_size, args.warmup, args.steps,
                                  async_scheduling=pipelined, device_ms=args.device_ms)
            metrics[f"critical_path_ms_{n}_{mode}"] = r["critical_mean_ms"]
            metrics[f"step_ms_{n}_{mode}"] = r["step_ms"]
            ratios[f"critical_path_fraction_{n}_{mode}"] = r["critical_mean_ms"] / r["step_ms"]
            print(f"{mode} engine, {args.device_ms:g} ms device steps, {n} decodes: host on the critical path "
                  f"{r['critical_mean_ms']:.3f} ms/step (median {r['critical_median_ms']:.3f}) = "
                  f"{r['critical_mean_ms'] / r['step_ms']:.2%} of {r['step_ms']:.3f} ms")
    waste = kv_waste(1000, args.block_size, 4096, seed=0)
    ratios.update(kv_waste_fraction=waste["kv_waste_fraction"],
                  kv_waste_fraction_if_reserved=waste["kv_waste_fraction_if_reserved"])
    print(f"KV waste {waste['kv_waste_fraction']:.4f} (reserving max_model_len: "
          f"{waste['kv_waste_fraction_if_reserved']:.4f}) over {waste['steps']} steps")
    if args.vllm_python:
        peer = run_vllm(args.vllm_python, args.n, args.prompt_len)
        metrics.update(parse_vllm(peer, args.n))
        for n in args.n:
            if f"vllm_total_ms_{n}" in metrics:
                ratios[f"host_vs_vllm_{n}"] = metrics[f"host_ms_per_step_{n}"] / metrics[f"vllm_total_ms_{n}"]
        print({k: v for k, v in metrics.items() if k.startswith("vllm")}, ratios)
    write_result(args, metrics, ratios)
    return 0


def parse_vllm(peer: dict, n_values: list[int]) -> dict:
    """Reads the medians vLLM's benchmark prints as JSON lines (scheduler schedule+update, runner input prep)."""
    out = {}
    sched = {line["n"]: line for line in _json_lines(peer["scheduler_raw"])}
    for n in n_values:
        runner = {line["n"]: line for line in _json_lines(peer.get(f"runner_raw_{n}", ""))}
        if n in sched:
            out[f"vllm_scheduler_ms_{n}"] = sched[n]["schedule_plus_update"]["median_us"] / 1e3
        if n in runner:
            out[f"vllm_runner_prep_ms_{n}"] = runner[n]["sum"]["median_us"] / 1e3
        if n in sched and n in runner:
            out[f"vllm_total_ms_{n}"] = out[f"vllm_scheduler_ms_{n}"] + out[f"vllm_runner_prep_ms_{n}"]
    return out


def _json_lines(text: str) -> list[dict]:
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return lines


def write_result(args, metrics: dict, ratios: dict) -> None:
    import jax

    git_sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    date = datetime.date.today().isoformat()
    result = {
        "benchmark": "host_overhead", "git_sha": git_sha, "date": date,
        "device": f"host only: {platform.processor() or platform.machine()}, {os_cpus()} cores (development machine)",
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "numpy": np.__version__},
        "command": "python " + " ".join(sys.argv), "metrics": metrics, "ratios": ratios,
    }
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"{date}-host_overhead.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {out}")


def os_cpus() -> int:
    import os

    return os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
