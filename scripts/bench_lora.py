"""GPU benchmark of multi-LoRA serving: correctness first, then the decode step with adapters against the base model's.

1. Correctness (a tiny float32 Llama, random weights): a LoRA adapter served by the engine against the same base with
   that adapter merged into its weights in numpy (W + scale · B A) and served as a plain model; greedy tokens must be
   identical and chosen-token logprobs within 2e-3, for each of four adapters in one mixed batch with the base.
2. Timing (Llama-3.1-8B shape, random bf16 weights made on the device by load_format='dummy'; rank-16 adapters on all seven projections,
   random): the jitted decode step replayed back to back on a recorded step's inputs (one synchronisation per run),
   at batch 64 with 8 distinct adapters (8 requests each) and at batch 1 with one adapter (an engine of one slot,
   vLLM's default `max_loras`; `lora_b1_all_slots_step_ms` is the same request on the 8-slot engine), each over
   the same batch on an engine without LoRA. `metrics.lora_load_seconds`: one adapter read from its directory and written into a
   device slot (the slow path), to the end of the write.

Writes `<out>/<date>-lora.json` (ratios.lora_step_vs_base_b64, ratios.lora_step_vs_base_b1, metrics.lora_load_seconds).

    PYTHONPATH=. python scripts/bench_lora.py --out benchmarks/results --git-sha $(git rev-parse --short HEAD)
    PYTHONPATH=. python scripts/bench_lora.py --out /tmp/lora --shape tiny   # the CPU version of the same run
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from jengine import LLM, LoRARequest, SamplingParams  # noqa: E402
from jengine.models.demo import build_random_llama  # noqa: E402
from check_pipeline_gpu import Recorder, device_seconds  # noqa: E402
from gpu_bench_common import (  # noqa: E402
    jax_device_name, log, print_tables, result_record, versions, write_record,
)

LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=4096)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=4096)
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
LOGPROB_TOL = 2e-3


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a Llama config."""
    d, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "gate_proj": (d, inter),
            "up_proj": (d, inter), "down_proj": (inter, d)}


def write_adapter(out: Path, config: dict, rank: int, seed: int, std: float = 0.02) -> dict[str, np.ndarray]:
    """A PEFT directory with random A/B on every projection of every layer; returns its tensors."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (d_in, d_out) in projection_shapes(config).items():
            name = f"base_model.model.model.layers.{layer}.{PROJECTIONS[module]}.{module}"
            tensors[name + ".lora_A.weight"] = (rng.standard_normal((rank, d_in)) * std).astype(np.float32)
            tensors[name + ".lora_B.weight"] = (rng.standard_normal((d_out, rank)) * std).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": list(PROJECTIONS)}))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return tensors


def merged_checkpoint(base: Path, out: Path, tensors: dict[str, np.ndarray], scale: float) -> Path:
    """The base checkpoint with an adapter merged in numpy: W + scale · B A (the independent reference)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(base, out)
    weights = load_file(str(base / "model.safetensors"))
    for name, a in tensors.items():
        if name.endswith(".lora_A.weight"):
            b = tensors[name.replace("lora_A", "lora_B")]
            target = name.removeprefix("base_model.model.").replace(".lora_A", "")
            weights[target] = (weights[target].astype(np.float64) + scale * (b.astype(np.float64) @ a)).astype(
                np.float32)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def check_correctness(work: Path, rank: int = 8) -> dict[str, Any]:
    """Four adapters and the base in one batch, against merged checkpoints served as plain models."""
    config = dict(TINY, num_hidden_layers=2)
    base = build_random_llama(work / "tiny", **config)
    full = json.loads((base / "config.json").read_text())
    adapters = [(work / f"tiny-adapter{i}", write_adapter(work / f"tiny-adapter{i}", full, rank, i, std=0.3))
                for i in range(4)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (7, 19, 33)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    requests = [LoRARequest(f"a{i}", i + 1, str(path)) for i, (path, _) in enumerate(adapters)] + [None]
    pairs = [(p, r) for p in prompts for r in requests]
    with LLM(str(base), dtype="float32", max_model_len=128, enable_lora=True, max_loras=4, max_lora_rank=16) as llm:
        mixed = llm.generate([{"prompt_token_ids": p} for p, _ in pairs], params, use_tqdm=False,
                             lora_request=[r for _, r in pairs])
    worst, identical = 0.0, 0
    for index, (path, tensors) in enumerate([(base, None)] + adapters):
        model = base if tensors is None else merged_checkpoint(base, work / f"merged{index}", tensors, 2.0)
        with LLM(str(model), dtype="float32", max_model_len=128) as llm:
            refs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wanted = None if tensors is None else requests[index - 1]
        ours = [o for (p, r), o in zip(pairs, mixed) if r == wanted]
        for got, ref in zip(ours, refs):
            a, b = got.outputs[0], ref.outputs[0]
            identical += a.token_ids == b.token_ids
            if a.token_ids == b.token_ids:
                diffs = [abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids)]
                worst = max(worst, max(diffs))
    total = len(prompts) * 5
    if identical != total or worst > LOGPROB_TOL:
        raise SystemExit(f"LoRA outputs differ from the merged reference: {identical}/{total} identical, "
                         f"max logprob difference {worst:.2e}")
    return {"correct_identical_greedy": identical, "correct_requests": total, "correct_max_logprob_diff": worst}


def decode_step_seconds(llm: LLM, prompts: list[list[int]], params: SamplingParams, lora: list | None) -> float:
    """Median device time of the jitted decode step of every request, replayed on a recorded step's inputs."""
    run_step = llm._core.runner._step
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora)  # compiles
    recorder = Recorder(llm, len(prompts))
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora)
    return device_seconds(llm, recorder, run_step)


def load_seconds(llm: LLM, request: LoRARequest) -> float:
    """An adapter read from its directory and written into slot 0, to the end of the device write."""
    import jax

    core = llm._core
    core.add_lora(request)
    lora = core.runner.lora
    lora.cache._loaded.clear()  # the slow path: nothing in host memory
    start = time.perf_counter()
    core.runner.params = lora.apply({0: request.lora_name}, core.runner.params)
    jax.block_until_ready((lora.slots.arrays, core.runner.params))
    return time.perf_counter() - start


def timing(work: Path, args: argparse.Namespace) -> tuple[dict, dict]:
    shape = LLAMA31_8B if args.shape == "llama3-8b" else TINY
    model_dir = build_random_llama(work / "bench-model", num_hidden_layers=0, **shape)  # config and tokenizer
    (model_dir / "model.safetensors").unlink()  # load_format='dummy' makes the weights on the device
    config = json.loads((model_dir / "config.json").read_text()) | {"num_hidden_layers": args.layers}
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    paths = [work / f"adapter{i}" for i in range(args.adapters)]
    for i, path in enumerate(paths):
        write_adapter(path, config, args.rank, seed=100 + i)
    requests = [LoRARequest(f"bench{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, size=args.prompt_len).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = dict(dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 16, max_num_seqs=args.batch,
                  max_num_batched_tokens=args.batch * args.prompt_len, enable_prefix_caching=False,
                  compile_buckets="lazy", num_gpu_blocks_override=args.batch * 16 + 64, load_format="dummy")
    lora_args = dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    per_request = [requests[i % args.adapters] for i in range(args.batch)]
    results = {}
    for name, extra in (("base", {}), ("lora", lora_args)):
        with LLM(str(model_dir), **engine, **extra) as llm:
            lora_b64 = per_request if extra else None
            results[f"{name}_b{args.batch}"] = decode_step_seconds(llm, prompts, params, lora_b64)
            results[f"{name}_b1" + ("_all_slots" if extra else "")] = decode_step_seconds(
                llm, prompts[:1], params, requests[:1] if extra else None)
            if extra:
                results["load"] = min(load_seconds(llm, LoRARequest(f"load{i}", 100 + i, str(paths[i])))
                                      for i in range(min(3, args.adapters)))
    # batch 1 with one adapter, as served: one slot (vLLM's default max_loras); the step above read all the slots
    with LLM(str(model_dir), **engine, **(lora_args | dict(max_loras=1))) as llm:
        results["lora_b1"] = decode_step_seconds(llm, prompts[:1], params, requests[:1])
    metrics = {f"{k}_step_ms": v * 1e3 for k, v in results.items() if k != "load"}
    metrics["lora_load_seconds"] = results["load"]
    ratios = {"lora_step_vs_base_b64": results[f"lora_b{args.batch}"] / results[f"base_b{args.batch}"],
              "lora_step_vs_base_b1": results["lora_b1"] / results["base_b1"]}
    return metrics, ratios


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="directory of the results file")
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--shape", default="llama3-8b", choices=["llama3-8b", "tiny"])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    log("correctness: LoRA against merged checkpoints ...")
    metrics = check_correctness(work)
    log(json.dumps(metrics))
    timed, ratios = timing(work, args)
    record = result_record("lora", args.git_sha, jax_device_name(), versions(), " ".join(sys.argv),
                           {**metrics, **timed}, ratios, shape=args.shape, layers=args.layers, rank=args.rank,
                           adapters=args.adapters, batch=args.batch,
                           method="decode step: the jitted step replayed on a recorded decode step's inputs "
                                  "(check_pipeline_gpu.device_seconds); base = the same batch on an engine without "
                                  "LoRA")
    path = Path(args.out) / f"{datetime.date.today().isoformat()}-lora.json"
    write_record(path, record)
    print_tables(record)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
