"""Where the runner's dispatch spends its host time on the GPU, and what packing the step's host inputs saves.

For each variant (`packed`: the step's numpy inputs as one buffer, `runner/host_pack.py`; `unpacked`: each numpy
leaf its own jit argument, as before), in one process on one model (dummy weights of a moe_shapes.py shape):
the runner's dispatch time per step (median), the jitted step call's share of it, the decode ms per step by
difference (--decode-steps against 1) and, with --profile, a cProfile of dispatch by own time (it inflates the
times). Then what the step's numpy leaves cost to send on their own: one device_put per leaf, one for the tree, one
packed buffer; a jit over them as numpy and as device arrays.

    PYTHONPATH=. python scripts/probe_host_dispatch_gpu.py --layers 32 --batch 1 --out $OUT/host.json
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
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench_common import median  # noqa: E402
from moe_shapes import write_shape  # noqa: E402

from jengine import LLM, SamplingParams  # noqa: E402
from jengine.runner import runner as runner_module  # noqa: E402
from jengine.runner import step as step_module  # noqa: E402
from jengine.runner.host_pack import pack  # noqa: E402


def median_ms(seconds: list[float]) -> float:
    return median(seconds) * 1e3


def unpacked(tree: Any) -> Any:
    """The old calling convention: the tree itself (`unpack` passes a tree that is not Packed through)."""
    return tree


def set_packing(on: bool) -> None:
    step_module.pack = runner_module.pack = pack if on else unpacked


def decode_ms(llm: LLM, prompts: list[dict], steps: int) -> float:
    def run(new_tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    runs = [(run(steps + 1) - run(1)) / steps for _ in range(3)]
    return median_ms(runs)


def variant(llm: LLM, prompts: list[dict], decode_steps: int, profiled: bool) -> dict[str, Any]:
    runner = llm._core.runner
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compiles this variant's programs
    dispatch_s, step_s = [], []
    real_dispatch, real_step = runner.dispatch, runner._step
    profile = cProfile.Profile()

    def dispatch(*args, **kwargs):
        start = time.perf_counter()
        if profiled:
            profile.enable()
        try:
            return real_dispatch(*args, **kwargs)
        finally:
            if profiled:
                profile.disable()
            dispatch_s.append(time.perf_counter() - start)

    def step(*args):
        start = time.perf_counter()
        try:
            return real_step(*args)
        finally:
            step_s.append(time.perf_counter() - start)

    runner.dispatch, runner._step = dispatch, step
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.dispatch, runner._step = real_dispatch, real_step
    text = io.StringIO()
    if profiled:
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
    return {"dispatch_ms": median_ms(dispatch_s), "step_call_ms": median_ms(step_s),
            "decode_ms_per_step": decode_ms(llm, prompts, decode_steps), "profile": text.getvalue()}


def leaf_costs(llm: LLM) -> dict[str, float]:
    """What the step's numpy inputs cost to send, as leaves and as one buffer (ms, median of 200)."""
    captured: dict[str, Any] = {}
    runner = llm._core.runner
    real_step = runner._step

    def capture(params, state, batch):
        captured["batch"] = batch
        return real_step(params, state, batch)

    runner._step = capture
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
    runner._step = real_step
    leaves = [x for x in jax.tree_util.tree_leaves(captured["batch"]) if isinstance(x, np.ndarray)]
    device = jax.devices()[0]
    use_all = jax.jit(lambda xs: [x.ravel()[:1] for x in xs])  # every leaf used: jit drops unused arguments
    packed = np.concatenate([x.view(np.uint8).ravel() for x in leaves])
    on_device = jax.device_put(leaves, device)

    def bench(fn, calls: int = 200) -> float:
        jax.block_until_ready(fn())
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - start)
        jax.block_until_ready(out)
        return median_ms(times)

    return {"numpy_leaves": len(leaves), "bytes": int(packed.nbytes),
            "device_put_each_ms": bench(lambda: [jax.device_put(x, device) for x in leaves]),
            "device_put_tree_ms": bench(lambda: jax.device_put(leaves, device)),
            "device_put_packed_ms": bench(lambda: jax.device_put(packed, device)),
            "jit_numpy_leaves_ms": bench(lambda: use_all(leaves)),
            "jit_device_leaves_ms": bench(lambda: use_all(on_device))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--decode-steps", type=int, default=64, help="decode steps timed by difference")
    parser.add_argument("--profile", action="store_true", help="cProfile dispatch (inflates its time)")
    parser.add_argument("--out")
    args = parser.parse_args()
    model = write_shape(args.shape, tempfile.mkdtemp(), num_layers=args.layers)
    llm = LLM(str(model), load_format="dummy", max_model_len=1024, max_num_seqs=max(max(args.batch), 8),
              max_num_batched_tokens=512, gpu_memory_utilization=0.85)
    result: dict[str, Any] = {"device": jax.devices()[0].device_kind, "shape": args.shape, "layers": args.layers,
                              "param_leaves": len(jax.tree_util.tree_leaves(llm._core.runner.step_params))}
    for batch in args.batch:
        prompts = [{"prompt_token_ids": list(range(3, 259))} for _ in range(batch)]
        for name, on in (("unpacked", False), ("packed", True), ("unpacked_again", False)):
            set_packing(on)
            figures = variant(llm, prompts, args.decode_steps, args.profile)
            print(f"b{batch} {name}: dispatch {figures['dispatch_ms']:.3f} ms, step call "
                  f"{figures['step_call_ms']:.3f} ms, decode {figures['decode_ms_per_step']:.3f} ms/step", flush=True)
            print(figures["profile"], flush=True)
            result[f"b{batch}_{name}"] = figures
    set_packing(True)
    result["leaf_costs"] = leaf_costs(llm)
    print(json.dumps(result["leaf_costs"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
