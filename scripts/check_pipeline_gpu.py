"""GPU check of the step pipeline: how much host time stays on the critical path of a steady decode step.

Builds a random-weight Llama (Llama-3-8B layers, fewer of them; tiny vocabulary) and decodes `--requests` greedy
requests with `--prompt-len`-token prompts through `LLM`, pipelined (`async_scheduling=True`) and serially. The step
period is the median interval between the starts of consecutive engine steps that are pure decodes of every request
(what the user sees, host work included); the device time is the median time of the runner's jitted step replayed
back to back on one such step's inputs (one synchronisation per run). Host time on the critical path = period −
device time, as a fraction of the period. Greedy outputs of the two modes are compared too. Writes JSON to --out.

    PYTHONPATH=. python scripts/check_pipeline_gpu.py --out $OUT/pipeline_check.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jengine import LLM, SamplingParams  # noqa: E402
from jengine.models.demo import build_random_llama  # noqa: E402

LLAMA3_8B_LAYER = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=4096)
REPLAY_CALLS, REPLAY_RUNS = 10, 5


class Recorder:
    """Start time and size of every engine step; the inputs of the last pure decode step of `batch` requests."""

    def __init__(self, llm: LLM, batch: int) -> None:
        core = llm._core
        self.starts: list[tuple[float, int, int]] = []  # (start, tokens, requests)
        self.decode_args: tuple | None = None
        self._size = (0, 0)
        schedule, step, run_step = core.scheduler.schedule, core.step, core.runner._step

        def recorded_schedule():
            out = schedule()
            self._size = (out.total_num_scheduled_tokens, len(out.num_scheduled_tokens))
            return out

        def recorded_step():
            start = time.perf_counter()
            result = step()
            self.starts.append((start, *self._size))
            return result

        def recorded_run_step(*args, **kwargs):
            if self._size == (batch, batch):
                self.decode_args = (args, kwargs)
            return run_step(*args, **kwargs)

        core.scheduler.schedule, core.step, core.runner._step = recorded_schedule, recorded_step, recorded_run_step

    def decode_periods(self, batch: int) -> list[float]:
        return [self.starts[i + 1][0] - start for i, (start, tokens, requests) in enumerate(self.starts[:-1])
                if tokens == requests == batch]


def device_seconds(llm: LLM, recorder: Recorder, run_step) -> float:
    """Median time of the jitted decode step replayed on its recorded inputs (the cache fed from call to call)."""
    import jax

    runner = llm._core.runner
    args, kwargs = recorder.decode_args
    args = list(args)
    args[1] = runner.state  # the recorded state was donated; the current one has the same shapes

    def call() -> None:
        args[1], _ = run_step(*args, **kwargs)

    for _ in range(3):
        call()
    jax.block_until_ready(args[1])
    times = []
    for _ in range(REPLAY_RUNS):
        start = time.perf_counter()
        for _ in range(REPLAY_CALLS):
            call()
        jax.block_until_ready(args[1])
        times.append((time.perf_counter() - start) / REPLAY_CALLS)
    runner.state = args[1]
    return statistics.median(times)


def run(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace, pipelined: bool) -> dict[str, Any]:
    engine = dict(dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 16, max_num_seqs=args.requests,
                  max_num_batched_tokens=args.batched_tokens, async_scheduling=pipelined, seed=0,
                  enable_prefix_caching=False)  # the timed run then repeats the warm-up run's shapes
    with LLM(str(model_dir), **engine) as llm:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        run_step = llm._core.runner._step
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # compiles every shape
        recorder = Recorder(llm, len(prompts))
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        periods = recorder.decode_periods(len(prompts))
        device = device_seconds(llm, recorder, run_step)
    period = statistics.median(periods)
    return {"tokens": [o.outputs[0].token_ids for o in outputs], "generate_seconds": seconds,
            "decode_steps": len(periods), "step_ms": period * 1e3, "device_step_ms": device * 1e3,
            "critical_path_ms": (period - device) * 1e3, "critical_path_fraction": (period - device) / period}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batched-tokens", type=int, default=None, help="default: every prompt in one step")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", default="llama3-8b", choices=["llama3-8b", "tiny"])
    args = parser.parse_args()
    args.batched_tokens = args.batched_tokens or args.requests * args.prompt_len  # few step shapes to compile
    shape = dict(LLAMA3_8B_LAYER) if args.shape == "llama3-8b" else dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096)
    model_dir = build_random_llama(Path(tempfile.mkdtemp()) / "llama-random", num_hidden_layers=args.layers, **shape)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=args.prompt_len).tolist() for _ in range(args.requests)]
    results = {mode: run(model_dir, prompts, args, mode == "pipelined") for mode in ("pipelined", "serial")}
    same = sum(a == b for a, b in zip(results["pipelined"].pop("tokens"), results["serial"].pop("tokens")))
    summary = {"requests": args.requests, "prompt_len": args.prompt_len, "layers": args.layers, "shape": args.shape,
               "greedy_outputs_identical": same, **results}
    print(json.dumps(summary, indent=2))
    Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
