"""Tensor and expert parallelism on several GPUs of one host: correctness against one GPU, then decode speed.

Parts (each fits one call of the GPU machine; each comparison's sides run in the same call):
  dense_f32   Llama-3.1-8B-shaped random model in float32, TP = 1 vs each TP size: greedy tokens identical?
  dense_speed the same model in bfloat16: chosen-token logprobs vs TP = 1, then decode step time at batch 1, 64 and
              256 (128-token prompts) per TP size, against the floor = (weight + KV bytes per GPU) ÷ measured copy
              bandwidth + the step's all-reduces measured alone (2 per layer of [batch, hidden] bf16)
  moe         a reduced Mixtral (hidden 4096, 8 experts of 14336, 4 layers) in float32 with expert parallelism over
              all GPUs vs one GPU, greedy tokens, then bf16 logprobs
Step time: (time of a batch generating N2 tokens − time generating N1 tokens) ÷ (N2 − N1), EOS ignored, prompts
prefilled in both, so prefill and start-up cancel out.

`PYTHONPATH=. python scripts/bench_multigpu.py --part dense_f32 --tp 2 --out $OUT/multigpu.json --git-sha SHA`;
`--merge-from FILE` carries another call's figures into the same results file; `--tiny` runs a small model (CPU).
NVLink multicast stays off in this process and its children (NCCL_NVLS_ENABLE=0 and friends), as the machine sets.
"""

from __future__ import annotations

import os

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_checkpoint as ckpt  # noqa: E402
import gpu_bench_common as common  # noqa: E402
from gpu_bench_common import log  # noqa: E402

MIXTRAL_REDUCED = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 4,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 32768, "rope_theta": 1e6, "num_local_experts": 8,
                   "num_experts_per_tok": 2}
TINY_MOE = {**ckpt.TINY, "num_local_experts": 4, "num_experts_per_tok": 2}
PROMPT_LEN, GREEDY_PROMPTS, GREEDY_TOKENS = 128, 8, 32
BATCHES, N1, N2 = (1, 64, 256), 8, 40


def mixtral_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF Mixtral names: attention as Llama, `block_sparse_moe` with a router and w1/w3 (gate/up), w2 (down)."""
    dense = {"intermediate_size": 1, **{k: v for k, v in config.items() if k != "intermediate_size"}}
    shapes = {n: s for n, s in ckpt.tensor_shapes(dense).items() if ".mlp." not in n}
    d, inter, experts = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.block_sparse_moe."
        shapes[p + "gate.weight"] = (experts, d)
        for e in range(experts):
            shapes |= {p + f"experts.{e}.w1.weight": (inter, d), p + f"experts.{e}.w3.weight": (inter, d),
                       p + f"experts.{e}.w2.weight": (d, inter)}
    return shapes


def write_mixtral(out: Path, shape: dict) -> Path:
    config = {**ckpt.llama_config(shape), "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    return ckpt.write_checkpoint(out, config, mixtral_shapes(config))


def prompts(vocab: int, count: int, length: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, vocab, size=length).tolist()} for _ in range(count)]


def engine(model: Path, dtype: str, tp: int, ep: bool = False, max_num_seqs: int = 8, backend: str = "auto",
           blocks: int | None = None):
    from jengine import LLM

    return LLM(str(model), dtype=dtype, tensor_parallel_size=tp, enable_expert_parallel=ep, max_model_len=1024,
               max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, compile_buckets="lazy", seed=0,
               attention_backend=backend, num_gpu_blocks_override=blocks)


def greedy_run(model: Path, dtype: str, tp: int, batch: list[dict], out: dict, ep: bool = False):
    """Greedy tokens on the default (kernel) backend; if that fails, the failure is recorded and the jnp reference
    backend answers instead, so the layout comparison still runs."""
    import traceback

    for backend in ("auto", "reference"):
        try:
            # a small exact pool: the greedy batch needs ~100 blocks, and float32 steps need room beside the weights
            llm = engine(model, dtype, tp, ep, backend=backend, blocks=1024)
            try:
                return greedy(llm, batch)
            finally:
                release(llm)
        except Exception as e:  # noqa: BLE001 - recorded, then the fallback runs
            cause = "".join(traceback.format_exception(e)[-3:])[-1500:]
            out.setdefault("errors", []).append(f"{dtype} tp={tp} ep={ep} backend={backend}: {cause}")
            log(f"FAILED {dtype} tp={tp} ep={ep} backend={backend}:\n{cause}")
    raise RuntimeError(f"{dtype} tp={tp} failed on every backend")


def greedy(llm, batch: list[dict]) -> tuple[list[list[int]], np.ndarray]:
    from jengine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(batch, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    chosen = np.array([[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                       for o in outs])
    return tokens, chosen


def step_time(llm, batch: list[dict]) -> float:
    """Seconds per decode step at this batch size, from two generation lengths."""
    from jengine import SamplingParams

    def run(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0

    run(N2)  # compiles every shape both lengths use
    return min((run(N2) - run(N1)) / (N2 - N1) for _ in range(2))


def all_reduce_seconds(tp: int, rows: int, hidden: int, count: int) -> float:
    """`count` dependent all-reduces of [rows, hidden] bf16 over `tp` GPUs in one straight-line program (as a step
    runs them: no loop, no host gaps), alone."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    if tp == 1:
        return 0.0
    mesh = jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:tp])
    x = jax.device_put(jnp.ones((tp * rows, hidden), jnp.bfloat16), NamedSharding(mesh, P("tp", None)))
    def reduce_many(a):
        for _ in range(count):
            a = jax.lax.psum(a, "tp") * 0.5
        return a

    fn = jax.jit(jax.shard_map(reduce_many, mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None),
                               check_vma=False))
    return common.timeit(fn, x, runs=5)


def diff_before_divergence(a: tuple[list[list[int]], np.ndarray], b: tuple[list[list[int]], np.ndarray]) -> float:
    """Largest chosen-token logprob difference over the positions where both runs still had the same tokens."""
    worst = 0.0
    for i, (ta, tb) in enumerate(zip(a[0], b[0])):
        same = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        if same:
            worst = max(worst, float(np.abs(a[1][i, :same] - b[1][i, :same]).max()))
    return worst


def weight_bytes(config: dict) -> int:
    """Bytes of every weight a decode step reads (bf16): all layers and the LM head, embedding rows negligible."""
    d, inter, hd, layers = (config[k] for k in ("hidden_size", "intermediate_size", "head_dim", "num_hidden_layers"))
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * inter + 2 * d
    return 2 * (layers * per_layer + config["vocab_size"] * d + d)


def kv_bytes(config: dict, batch: int, context: int) -> int:
    return 2 * 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * batch * context


def release(llm) -> None:
    llm.shutdown()
    del llm
    gc.collect()


def part_dense_f32(model: Path, sizes: list[int], vocab: int, out: dict) -> None:
    batch = prompts(vocab, GREEDY_PROMPTS, PROMPT_LEN, seed=1)
    results = {}
    for tp in [1, *sizes]:
        results[tp] = greedy_run(model, "float32", tp, batch, out)[0]
        log(f"float32 TP={tp}: greedy done")
    for tp in sizes:
        same = sum(a == b for a, b in zip(results[1], results[tp])) / len(batch)
        out["ratios"][f"tp{tp}_greedy_identical_f32"] = same
        log(f"TP={tp}: float32 greedy identical to TP=1 for {same:.0%} of prompts")
    out["ratios"]["tp_greedy_identical"] = min(out["ratios"][f"tp{tp}_greedy_identical_f32"] for tp in sizes)


def part_dense_speed(model: Path, sizes: list[int], config: dict, out: dict) -> None:
    _, bandwidth = common.copy_bandwidth()
    out["metrics"]["copy_tb_per_s"] = bandwidth / 1e12
    batch = prompts(config["vocab_size"], GREEDY_PROMPTS, PROMPT_LEN, seed=1)
    times: dict[int, dict[int, float]] = {}
    chosen: dict[int, tuple] = {}
    for tp in [1, *sizes]:
        llm = engine(model, "bfloat16", tp, max_num_seqs=max(BATCHES))
        chosen[tp] = greedy(llm, batch)
        times[tp] = {b: step_time(llm, prompts(config["vocab_size"], b, PROMPT_LEN, seed=b)) for b in BATCHES}
        release(llm)
        for b, t in times[tp].items():
            context = PROMPT_LEN + (N1 + N2) // 2
            reduce = all_reduce_seconds(tp, b, config["hidden_size"], 2 * config["num_hidden_layers"])
            floor = (weight_bytes(config) + kv_bytes(config, b, context)) / tp / bandwidth + reduce
            out["metrics"][f"tp{tp}_b{b}_step_ms"] = t * 1e3
            out["metrics"][f"tp{tp}_b{b}_tokens_per_s"] = b / t
            out["metrics"][f"tp{tp}_b{b}_floor_ms"] = floor * 1e3
            out["metrics"][f"tp{tp}_b{b}_all_reduce_ms"] = reduce * 1e3
            log(f"TP={tp} batch {b}: {t * 1e3:.2f} ms/step ({b / t:.0f} tok/s), floor {floor * 1e3:.2f} ms "
                f"(all-reduces {reduce * 1e3:.2f})")
    for tp in sizes:
        out["ratios"][f"tp{tp}_scaling_efficiency"] = times[1][64] / times[tp][64] / tp
        out["ratios"][f"tp{tp}_vs_floor"] = times[tp][64] / (out["metrics"][f"tp{tp}_b64_floor_ms"] / 1e3)
        out["metrics"][f"tp{tp}_bf16_max_logprob_diff"] = diff_before_divergence(chosen[tp], chosen[1])


def part_moe(model: Path, sizes: list[int], vocab: int, out: dict) -> None:
    batch = prompts(vocab, GREEDY_PROMPTS, PROMPT_LEN, seed=2)
    for dtype in ("float32", "bfloat16"):
        base = None
        for tp in [1, *sizes]:
            result = greedy_run(model, dtype, tp, batch, out, ep=tp > 1)
            if base is None:
                base = result
                continue
            if dtype == "float32":
                same = sum(a == b for a, b in zip(base[0], result[0])) / len(batch)
                out["ratios"][f"ep{tp}_greedy_identical_f32"] = same
                log(f"MoE EP={tp}: float32 greedy identical to EP=1 for {same:.0%} of prompts")
            else:
                diff = diff_before_divergence(result, base)
                out["metrics"][f"ep{tp}_bf16_max_logprob_diff"] = diff
                log(f"MoE EP={tp}: bfloat16 chosen logprobs within {diff:.4f} of EP=1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", required=True, choices=["dense_f32", "dense_speed", "moe"])
    parser.add_argument("--tp", default="2", help="comma-separated TP sizes beside 1 (e.g. 2,4,8)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--merge-from", default=None, help="a results file whose figures this call adds to")
    parser.add_argument("--workdir", default="/tmp/jengine-multigpu")
    parser.add_argument("--tiny", action="store_true", help="a small model (CPU check of the script)")
    args = parser.parse_args()
    import jax

    sizes = [int(s) for s in args.tp.split(",")]
    if max(sizes) > jax.device_count():
        parser.error(f"TP {max(sizes)} needs more than the {jax.device_count()} devices present")
    out = {"metrics": {}, "ratios": {}}
    work = Path(args.workdir)
    if args.part == "moe":
        shape = TINY_MOE if args.tiny else MIXTRAL_REDUCED
        model = write_mixtral(work / "mixtral", shape)
        part_moe(model, sizes, shape["vocab_size"], out)
    else:
        shape = ckpt.TINY if args.tiny else ckpt.LLAMA_31_8B
        model = work / "llama"
        if not (model / "config.json").exists():
            ckpt.write_random_llama(model, shape)
        if args.part == "dense_f32":
            part_dense_f32(model, sizes, shape["vocab_size"], out)
        else:
            part_dense_speed(model, sizes, ckpt.llama_config(shape), out)
    if out.get("errors"):
        out["metrics"]["errors"] = out["errors"]
    record = common.result_record(
        "multigpu", args.git_sha, common.jax_device_name() + f" ×{jax.device_count()}", common.versions(),
        "PYTHONPATH=. python scripts/bench_multigpu.py " + " ".join(sys.argv[1:]), out["metrics"], out["ratios"])
    if args.merge_from and Path(args.merge_from).exists():
        record = common.merge_records(common.read_record(args.merge_from), record)
    common.write_record(args.out, record)
    common.print_tables(record)


if __name__ == "__main__":
    main()
