"""How XLA's command buffers (CUDA graphs) and launch options change a small batch's decode step, in one call.

Each variant runs in its own process (XLA reads XLA_FLAGS once, at start-up) on the same dummy-weight model: the
decode step's ms by difference (a 65-token and a 1-token greedy generation of the same prompts, each timed after a
warm-up of its shapes, ÷ 64), the host time of the runner's dispatch per step, and a digest of the greedy tokens
(the variants must generate the same ones). Variants (`--variants`):

  default       XLA's own flags and the engine's default launch policy (`runner/launch.py`)
  graphs_off    no command buffers (`--xla_gpu_enable_command_buffer=`)
  graphs_all    every kind of kernel in command buffers, however short the run (min graph size 1)
  pdl           programmatic dependent launch (`--xla_gpu_enable_pdl=true`)
  enforce_eager the engine's `enforce_eager=True`: every step program compiled without command buffers
  all_graphs    the engine's `enforce_eager=False`: every step program with XLA's command buffers

    PYTHONPATH=. python scripts/probe_graphs_gpu.py --out $OUT/graphs.json --git-sha <sha>
    PYTHONPATH=. python scripts/probe_graphs_gpu.py --out /tmp/graphs.json --tiny --variants default graphs_off
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS: dict[str, tuple[str, dict]] = {
    "default": ("", {}),
    "graphs_off": ("--xla_gpu_enable_command_buffer=", {}),
    "graphs_all": ("--xla_gpu_graph_min_graph_size=1 "
                   "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN", {}),
    "pdl": ("--xla_gpu_enable_pdl=true", {}),
    "enforce_eager": ("", {"enforce_eager": True}),
    "all_graphs": ("", {"enforce_eager": False}),
}
PROMPT_LEN, NEW_TOKENS = 256, 64


def write_model(kind: str, layers: int, workdir: Path) -> Path:
    from check_determinism_gpu import LLAMA_8B_LAYERS, TINY
    from moe_shapes import write_shape

    path = workdir / f"{kind}-{layers}"
    if (path / "config.json").exists():
        return path
    if kind == "moe":
        return write_shape("qwen3-30b-a3b", path, num_layers=layers)
    import e2e_checkpoint

    path.mkdir(parents=True, exist_ok=True)
    shape = dict(TINY, num_hidden_layers=layers) if kind == "tiny" else dict(LLAMA_8B_LAYERS, num_hidden_layers=layers)
    (path / "config.json").write_text(json.dumps(e2e_checkpoint.llama_config(shape)))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    e2e_checkpoint.write_tokenizer(path, shape["vocab_size"])
    return path


def measure(model_dir: str, batches: list[int], engine_kwargs: dict) -> dict:
    """In this process: decode ms per step, dispatch ms per step and the tokens' digest at each batch."""
    from jengine import LLM, SamplingParams
    from jengine.runner import runner as runner_module

    dispatch_s: list[float] = []
    original = runner_module.ModelRunner.dispatch

    def timed_dispatch(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            dispatch_s.append(time.perf_counter() - start)

    runner_module.ModelRunner.dispatch = timed_dispatch
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(1)
    result = {}
    with LLM(model_dir, load_format="dummy", max_model_len=1024, max_num_seqs=max(batches),
             enable_prefix_caching=False, compile_buckets="lazy", **engine_kwargs) as llm:
        for batch in batches:
            prompts = [{"prompt_token_ids": rng.integers(3, min(vocab, 500), PROMPT_LEN).tolist()}
                       for _ in range(batch)]

            def run(n: int) -> tuple[float, float, list]:
                params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
                llm.generate(prompts, params, use_tqdm=False)  # warm-up: the same shapes compiled
                dispatch_s.clear()
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                return time.perf_counter() - start, sum(dispatch_s), [o.outputs[0].token_ids for o in outs]

            long_s, long_dispatch, tokens = run(NEW_TOKENS + 1)
            short_s, short_dispatch, _ = run(1)
            result[f"b{batch}"] = {
                "decode_ms": (long_s - short_s) / NEW_TOKENS * 1e3,
                "dispatch_ms_per_step": (long_dispatch - short_dispatch) / NEW_TOKENS * 1e3,
                "tokens_digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
            }
            print(json.dumps({"batch": batch, **result[f"b{batch}"]}), file=sys.stderr, flush=True)
    return result


def run_variant(name: str, model_dir: Path, batches: list[int], timeout: float) -> dict:
    flags, engine_kwargs = VARIANTS[name]
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    cmd = [sys.executable, __file__, "--child", str(model_dir), "--batches", *map(str, batches),
           "--engine-kwargs", json.dumps(engine_kwargs)]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    record = {"xla_flags": flags, "engine_kwargs": engine_kwargs, "wall_s": time.perf_counter() - start}
    if done.returncode != 0:
        return record | {"error": done.stderr[-2000:]}
    return record | json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--models", nargs="+", default=["llama8b:32", "moe:32"], help="KIND:LAYERS (llama8b, moe)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer tiny model (the CPU: paths only)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--variant-timeout", type=float, default=240.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--engine-kwargs", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.batches, json.loads(args.engine_kwargs))))
        return
    models = ["tiny:2"] if args.tiny else args.models
    workdir = Path(tempfile.mkdtemp(prefix="graphs-"))
    record = {"git_sha": args.git_sha, "models": {}}
    for spec in models:
        kind, layers = spec.split(":")
        model_dir = write_model(kind, int(layers), workdir)
        results = record["models"][spec] = {}
        for name in args.variants:
            results[name] = run_variant(name, model_dir, args.batches, args.variant_timeout)
            print(f"{spec} {name}: {json.dumps(results[name])[:400]}", flush=True)
            Path(args.out).write_text(json.dumps(record, indent=1))  # a call cut short keeps what it measured


if __name__ == "__main__":
    main()
