"""The jengine side of the end-to-end benchmark, run in its own process (it owns the GPU while it runs).

Every engine in one GPU call has the same configuration (bf16, attention backend auto, compile_buckets="all", a
fixed KV pool), so each compiles the same executables and all but the first load them from the call's persistent
compilation cache.

How the engine is timed, without changing it: `StepRecorder` wraps the core's `step` (start time of each step) and
its scheduler's `schedule` (what each step computes). The step time at batch B is the median interval between the
starts of consecutive steps that are pure decodes of exactly B requests: the period the user sees, host work
included. Device time: at one such step the runner's jitted step is called again back to back with the same inputs
(the cache fed from call to call, one synchronisation per run), which recomputes the same K/V into the same slots,
so the engine's state is unchanged; the median per-call time is the time the device is busy per step.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from e2e_workload import Request, fixed_prompts
from gpu_bench_common import copy_bandwidth, jax_device_name, log, matmul_rate, replay_seconds, versions

REPLAY_AT = 8  # replay at the 8th eligible step: compiled and warm by then
REPLAY_CALLS, REPLAY_RUNS = 10, 3


class StepRecorder:
    """Start time and composition of every engine step, and optionally the device time of one decode step."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.steps: list[tuple[float, int, int, int]] = []  # (start, tokens, requests, context tokens)
        self._pending = (0, 0, 0)
        self.waste: list[float] = []  # unfilled / allocated KV slots of the running requests, per step
        self.track_waste = False
        self.replay_shape: tuple[int, int] | None = None  # (tokens, requests) of the steps eligible for the replay
        self.replay_at = REPLAY_AT  # which eligible step is replayed
        self.replay_seconds: float | None = None
        self._replayed_at = -1  # the step holding the replays: its period is left out of the step times
        self._eligible = 0
        self._wrap(core)

    def _wrap(self, core: Any) -> None:
        schedule, step, run_step = core.scheduler.schedule, core.step, core.runner._step

        def recorded_schedule():
            out = schedule()
            requests = core.scheduler.requests
            context = sum(requests[r].num_computed_tokens for r in out.num_scheduled_tokens)
            self._pending = (out.total_num_scheduled_tokens, len(out.num_scheduled_tokens), context)
            return out

        def recorded_step():
            start = time.perf_counter()
            result = step()
            self.steps.append((start, *self._pending))
            if self.track_waste and core.scheduler.running:
                allocated, unfilled = core.kv_manager.waste(core.scheduler.running)
                self.waste.append(unfilled / max(allocated, 1))
            return result

        def replaying_step(*args, **kwargs):
            tokens, requests, _ = self._pending
            if self.replay_shape == (tokens, requests):
                self._eligible += 1
                if self._eligible == self.replay_at:
                    return self._replay(run_step, args, kwargs)
            return run_step(*args, **kwargs)

        core.scheduler.schedule, core.step, core.runner._step = recorded_schedule, recorded_step, replaying_step

    def _replay(self, run_step: Callable, args: tuple, kwargs: dict) -> Any:
        """Times the runner's step on these inputs, then makes the real call (with the cache the replays left)."""
        args = list(args)  # (params, state, batch): each call donates the state and returns the next one

        def call() -> Any:
            out = run_step(*args, **kwargs)
            args[1] = out[0]
            return out

        self.replay_seconds = replay_seconds(lambda: call()[0], warmup=2, runs=REPLAY_RUNS, calls=REPLAY_CALLS)
        self._replayed_at = len(self.steps)  # this step is appended next
        return run_step(*args, **kwargs)

    def replay(self, tokens: int, requests: int, at: int = REPLAY_AT) -> None:
        """Replays the `at`-th step from now that computes `tokens` tokens of `requests` requests."""
        self.replay_shape, self.replay_at, self._eligible, self.replay_seconds = (tokens, requests), at, 0, None

    def clear(self) -> None:
        self.steps.clear()
        self.waste.clear()
        self._replayed_at = -1

    def decode_periods(self, batch: int) -> tuple[list[float], list[float]]:
        """Periods of pure-decode steps of exactly `batch` requests, and their mean context per request."""
        periods, contexts = [], []
        for i, (start, tokens, requests, context) in enumerate(self.steps[:-1]):
            if tokens == requests == batch and i != self._replayed_at:
                periods.append(self.steps[i + 1][0] - start)
                contexts.append(context / batch)
        return periods, contexts


def engine_kwargs(task: dict[str, Any], prefix_caching: bool = True) -> dict[str, Any]:
    return dict(task["engine"], dtype="bfloat16", attention_backend="auto", compile_buckets="all",
                compilation_cache_dir=task["cache_dir"], enable_prefix_caching=prefix_caching, seed=0)


def build_llm(task: dict[str, Any], prefix_caching: bool = True) -> Any:
    from jengine import LLM

    from jengine.attention import backend

    if task.get("invariant_segment") is not None:
        backend.INVARIANT_SEGMENT = task["invariant_segment"] or None  # static in the backend: programs key on it
    if task.get("segments_apart"):
        backend.SHORT_STEP_SEGMENTS_APART = True  # likewise
    if task.get("mosaic_decode"):
        import os

        from jengine.runner.program_store import STORE_SWITCH
        from pallas_kernels.ragged_paged_attention import tuning

        block_kv, slots, split, *prefetch = task["mosaic_decode"]
        tuning.MOSAIC_DECODE_ON_HOPPER = tuning.MosaicDecodeConfig(block_kv, slots, split,
                                                                    bool(prefetch and prefetch[0]))
        os.environ[STORE_SWITCH] = "off"  # the saved programs' key does not see the kernels' tuning
    return LLM(task["model_dir"], **engine_kwargs(task, prefix_caching))


def greedy(max_tokens: int) -> Any:
    from jengine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm: Any, prompts: list[list[int]], params: Any) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def ceilings(task: dict[str, Any]) -> dict[str, float]:
    """The measured copy bandwidth (bytes read + written) and bf16 matrix rate, in this process, beside the engine:
    1 GiB moved (read + written; 20× an H100's L2), which fits what an 80 GiB card leaves beside weights and pool."""
    tiny = task["tiny"]
    _, copy = copy_bandwidth(1 << 20 if tiny else 1 << 28, min_calls=1 if tiny else 5)
    flops = matmul_rate(256 if tiny else 8192, min_calls=1 if tiny else 5)
    log(f"  copy {copy / 1e12:.3f} TB/s, bf16 matmul {flops / 1e12:.1f} TFLOP/s")
    return {"copy_bytes_per_s": copy, "matmul_flops_per_s": flops}


def run_shapes(llm: Any, recorder: StepRecorder, prompt_sets: dict[int, dict[str, list]], new_tokens: int,
               short_tokens: int) -> dict[str, Any]:
    """Per batch size: decode step time (direct, and by HF's difference of long and short runs as a cross-check)."""
    metrics: dict[str, float] = {}
    first_tokens: dict[str, list[int]] = {}
    for batch, sets in sorted(prompt_sets.items()):
        _, warm = generate(llm, sets["warm"], greedy(new_tokens))
        first_tokens[f"jengine_b{batch}"] = [o.outputs[0].token_ids[0] for o in warm]
        periods, contexts, long_s, short_s = [], [], [], []
        for long_prompts, short_prompts in zip(sets["long"], sets["short"], strict=True):
            recorder.clear()
            long_s.append(generate(llm, long_prompts, greedy(new_tokens))[0])
            p, c = recorder.decode_periods(batch)
            periods += p
            contexts += c
            short_s.append(generate(llm, short_prompts, greedy(short_tokens))[0])
        if not periods:
            raise RuntimeError(f"no pure decode step of {batch} requests was seen")
        step = statistics.median(periods)
        metrics |= {f"jengine_decode_ms_b{batch}": step * 1e3, f"jengine_decode_steps_b{batch}": len(periods),
                    f"jengine_decode_context_b{batch}": statistics.mean(contexts),
                    f"jengine_decode_ms_b{batch}_by_difference":
                        (statistics.median(long_s) - statistics.median(short_s)) / (new_tokens - short_tokens) * 1e3,
                    f"jengine_tokens_per_s_b{batch}": batch * new_tokens / statistics.median(long_s)}
        log(f"  jengine batch {batch}: {step * 1e3:.2f} ms/step over {len(periods)} steps")
    return {"metrics": metrics, "first_tokens": first_tokens}


def run_mixed(llm: Any, recorder: StepRecorder, requests: list[Request], warm_prompts: list[list[int]]
              ) -> dict[str, Any]:
    """Output tokens per second over the whole mixed workload in one `generate`, and the KV waste along the way."""
    from jengine import SamplingParams

    generate(llm, warm_prompts, greedy(8))
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    recorder.clear()
    recorder.track_waste = True
    elapsed, outputs = generate(llm, [r.prompt for r in requests], params)
    recorder.track_waste = False
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    asked = sum(r.max_tokens for r in requests)
    if produced != asked:
        raise RuntimeError(f"jengine produced {produced} output tokens, {asked} were asked for")
    log(f"  jengine mixed: {produced} tokens in {elapsed:.1f} s = {produced / elapsed:.1f} tok/s")
    return {"metrics": {"jengine_mixed_seconds": elapsed, "jengine_mixed_tokens_per_s": produced / elapsed,
                        "jengine_mixed_output_tokens": produced, "jengine_mixed_steps": len(recorder.steps),
                        "kv_waste_fraction": statistics.mean(recorder.waste),
                        "jengine_mixed_preemptions": llm._core.stats().num_preemptions_total}}


def run_decode_roofline(llm: Any, recorder: StepRecorder, prompts: list[list[int]], max_tokens: int
                        ) -> dict[str, Any]:
    """Decode of len(prompts) requests with long contexts: wall step time, device time per step, contexts."""
    batch = len(prompts)
    recorder.clear()
    recorder.replay(batch, batch)
    generate(llm, prompts, greedy(max_tokens))
    recorder.replay_shape = None
    periods, contexts = recorder.decode_periods(batch)
    if not periods or recorder.replay_seconds is None:
        raise RuntimeError(f"fewer than {REPLAY_AT} pure decode steps of {batch} requests were seen")
    step = statistics.median(periods)
    log(f"  jengine decode batch {batch}: {step * 1e3:.2f} ms/step wall, {recorder.replay_seconds * 1e3:.2f} ms "
        f"device, mean context {statistics.mean(contexts):.0f}")
    return {"metrics": {"jengine_roofline_batch": batch, "jengine_roofline_step_ms": step * 1e3,
                        "jengine_roofline_device_step_ms": recorder.replay_seconds * 1e3,
                        "jengine_roofline_steps": len(periods),
                        "jengine_roofline_context": statistics.mean(contexts)}}


def ttft(llm: Any, system: list[int], suffixes: list[list[int]]) -> list[float]:
    """Wall time of one-token `generate` calls for system + suffix, one request at a time; the first (which fills
    the prefix cache when it is on) is not counted."""
    times = [generate(llm, [system + s], greedy(1))[0] for s in suffixes]
    return times[1:]


def ttft_device_seconds(llm: Any, recorder: StepRecorder, system: list[int], suffix: list[int]) -> float:
    """Device time of the one step of a request whose `system` prefix is cached: that step, replayed (its own
    TTFT is not a sample, the replays sit inside it). TTFT minus this is the host's share."""
    recorder.replay(len(suffix), 1, at=1)
    generate(llm, [system + suffix], greedy(1))
    recorder.replay_shape = None
    if recorder.replay_seconds is None:
        raise RuntimeError(f"no step of {len(suffix)} tokens of one request was seen")
    return recorder.replay_seconds


def run_prefill(llm: Any, vocab: np.ndarray, lengths: list[int], runs: int) -> dict[str, Any]:
    """TTFT of one fresh prompt of each length at a time (one token): median of `runs` after a warm-up request."""
    metrics, samples = {}, {}
    for n in lengths:
        times = ttft(llm, [], fixed_prompts(vocab, runs + 1, n, seed=n))
        samples[f"ttft_prompt{n}_s"] = times
        metrics[f"ttft_prompt{n}_ms"] = statistics.median(times) * 1e3
        log(f"  prompt {n}: TTFT {metrics[f'ttft_prompt{n}_ms']:.1f} ms")
    return {"metrics": metrics, "samples": samples}


class StartupLog(logging.Handler):
    """The engine's INFO lines while it starts, each stamped with the seconds since the worker was spawned."""

    def __init__(self, spawned_at: float) -> None:
        super().__init__(logging.INFO)
        self.spawned_at = spawned_at
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.created - self.spawned_at:6.1f} s  {record.name}: {record.getMessage()}")


def start_to_first_token(task: dict[str, Any], spawned_at: float, prefix_caching: bool) -> tuple[Any, float]:
    """Builds the engine and generates one token; seconds since the parent spawned this process."""
    llm = build_llm(task, prefix_caching)
    generate(llm, [fixed_prompts(np.asarray(task["vocab"]), 1, 16, seed=99)[0]], greedy(1))
    return llm, time.time() - spawned_at


def work(task: dict[str, Any], sink: Any) -> None:
    """The worker's entry: one engine (or, for start-up, just its first token), then the role's sections."""
    from pathlib import Path

    from e2e_workload import load_requests, shape_prompt_sets

    role, vocab = task["role"], np.asarray(task["vocab"])
    sink.data["versions"] = versions()
    sink.data["device"] = jax_device_name()
    if role in ("cold", "warm_on", "warm_off"):
        engine_log, startup = logging.getLogger("jengine"), StartupLog(task["spawned_at"])
        engine_log.addHandler(startup)
        engine_log.setLevel(logging.INFO)
        try:
            llm, seconds = start_to_first_token(task, task["spawned_at"], prefix_caching=role != "warm_off")
        finally:
            engine_log.removeHandler(startup)
            sink.data["startup_log"] = startup.lines
        sink.metric({"cold": "cold_start_seconds", "warm_on": "warm_start_seconds",
                     "warm_off": "warm_start_seconds_caching_off"}[role], seconds)
        if role == "cold":
            return
    else:
        start = time.perf_counter()
        llm = build_llm(task)
        sink.metric(f"jengine_build_seconds_{role}", time.perf_counter() - start)
    recorder = StepRecorder(llm._core)
    if role in ("shapes", "warm_on", "prefill"):
        sink.section("ceilings", lambda: {"metrics": ceilings(task)})
    if role == "shapes":
        s = task["shapes"]
        sets = {b: shape_prompt_sets(vocab, b, s["prompt_len"], s["runs"], s["seed"]) for b in s["batch_sizes"]}
        sink.section("jengine shapes", lambda: run_shapes(llm, recorder, sets, s["new_tokens"], s["short_tokens"]))
    elif role == "prefill":
        p = task["prefill"]
        sink.section("TTFT by prompt length", lambda: run_prefill(llm, vocab, p["lengths"], p["runs"]))
    elif role == "mixed":
        requests = load_requests(Path(task["mixed"]["requests_file"]))
        warm = fixed_prompts(vocab, 8, 32, seed=7)
        sink.section("jengine mixed", lambda: run_mixed(llm, recorder, requests, warm))
    elif role in ("warm_on", "warm_off"):
        e = task["engine_part"]
        if role == "warm_on":
            prompts = fixed_prompts(vocab, e["batch"], e["prompt_len"], seed=11)
            sink.section("decode roofline", lambda: run_decode_roofline(llm, recorder, prompts, e["max_tokens"]))
        system = fixed_prompts(vocab, 1, e["system_len"], seed=13)[0]
        suffixes = fixed_prompts(vocab, e["ttft_requests"], e["suffix_len"], seed=17)
        key = "ttft_caching_on_s" if role == "warm_on" else "ttft_caching_off_s"
        sink.section(f"TTFT ({key})", lambda: {"samples": {key: ttft(llm, system, suffixes)}})
        if role == "warm_on":
            extra = fixed_prompts(vocab, 1, e["suffix_len"], seed=19)[0]
            sink.section("TTFT device time", lambda: {"metrics": {
                "ttft_caching_on_device_ms": ttft_device_seconds(llm, recorder, system, extra) * 1e3}})
    llm.shutdown()
