"""Is a request's output independent of its batch on the GPU? And what does `deterministic=True` cost?

For the default (fast) engine and `deterministic=True` alike, 64 greedy requests (random prompts of 20–700 tokens,
`--max-tokens` each) run first each alone, then five other ways: batched with 64 and with 192 random neighbours,
again on a warm prefix cache, batched under a 64-token step budget (chunked prefill), and under a 512-token budget
with a KV pool small enough to force preemption. A request counts as identical when its tokens and its top-5
logprobs (float32, with the chosen token's) at every position equal, bit for bit, those it had alone. Then the cost: a mixed workload
(`jengine bench throughput`'s sharegpt-like set, `--mixed` requests) in output tokens/s both ways, and the decode
step at batch 1 and 64 both ways. Model: Llama-3.1-8B-shaped layers (`--layers` of them) with random bf16 weights
made on the device, or the Qwen3-30B-A3B shape with `--moe`.

    PYTHONPATH=. python scripts/check_determinism_gpu.py --out $OUT --git-sha <sha> [--layers 8] [--moe]
    PYTHONPATH=. python scripts/check_determinism_gpu.py --tiny --out /tmp/det     # CPU: the script's paths only
`--parts ways` or `--parts cost` splits it over two calls (each merges into the day's file); `--parts long` times
the decode step at batch 1 and 8 after prompts of each `--long-context` length both ways (keys
`ratios.deterministic_decode_b{1,8}_ctx<N>_vs_fast`, the deterministic step ÷ the fast one).

Keys (`<date>-determinism.json`): `ratios.gpu_bitwise_identical_fraction` (deterministic, over requests × ways),
`ratios.fast_bitwise_identical_fraction` (the default engine, for comparison), `ratios.deterministic_throughput_vs_fast`,
`metrics.decode_b{1,64}_{fast,deterministic}_ms`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_checkpoint  # noqa: E402
import gpu_bench_common as common  # noqa: E402
from gpu_bench_common import log  # noqa: E402

LLAMA_8B_LAYERS = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, max_position_embeddings=2048, num_hidden_layers=2)
TOP = 5


def model_dir(args) -> Path:
    path = Path(args.workdir) / ("moe" if args.moe else "tiny" if args.tiny else f"llama8b-{args.layers}")
    if (path / "tokenizer.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    if args.moe:
        from moe_shapes import write_shape

        return write_shape("qwen3-30b-a3b", path, num_layers=args.layers)
    shape = TINY if args.tiny else dict(LLAMA_8B_LAYERS, num_hidden_layers=args.layers)
    (path / "config.json").write_text(json.dumps(e2e_checkpoint.llama_config(shape)))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    e2e_checkpoint.write_tokenizer(path, shape["vocab_size"])
    return path


def prompts(rng: np.random.Generator, count: int, vocab: int, low: int, high: int) -> list[list[int]]:
    return [rng.integers(3, vocab, size=int(n)).tolist() for n in rng.integers(low, high, size=count)]


def engine(path: Path, deterministic: bool, args, **overrides):
    from jengine import LLM

    engine_args = dict(dtype="bfloat16", load_format="dummy", seed=0, max_model_len=1024, max_num_seqs=256,
                       max_num_batched_tokens=8192, compile_buckets="lazy", deterministic=deterministic,
                       gpu_memory_utilization=0.5)  # headroom should an ended engine's arrays outlive it
    if args.tiny:
        engine_args.update(dtype="float32", max_num_batched_tokens=2048)
    return LLM(str(path), **(engine_args | overrides))


def outputs_of(llm, batch: list[list[int]], max_tokens: int) -> list[tuple[list[int], np.ndarray]]:
    """Per request: its tokens and, at every position, the (token id, logprob) pairs of its top 5 and the chosen
    token, sorted by id, flattened (float32)."""
    from jengine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)
    out = []
    for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False):
        top = np.array([v for lp in o.outputs[0].logprobs for t in sorted(lp) for v in (t, lp[t].logprob)],
                       np.float32)
        out.append((list(o.outputs[0].token_ids), top))
    return out


def same(a: tuple[list[int], np.ndarray], b: tuple[list[int], np.ndarray]) -> bool:
    return a[0] == b[0] and a[1].shape == b[1].shape and np.array_equal(a[1].view(np.uint32), b[1].view(np.uint32))


def ways(path: Path, deterministic: bool, args, requests, neighbours) -> dict[str, float]:
    """Per way, the fraction of the requests identical to themselves alone: bitwise, and in tokens only."""
    n = len(requests)
    with engine(path, deterministic, args) as llm:
        alone = [outputs_of(llm, [p], args.max_tokens)[0] for p in requests]
        runs = {"batch_128": outputs_of(llm, requests + neighbours[:n], args.max_tokens)[:n],
                "batch_256": outputs_of(llm, neighbours[n:] + requests, args.max_tokens)[-n:]}
        runs["prefix_cache_hit"] = outputs_of(llm, requests, args.max_tokens)
        hits = llm._core.kv_manager.prefix_cache_stats.hits
    with engine(path, deterministic, args, max_num_batched_tokens=64) as llm:
        runs["chunked_64"] = outputs_of(llm, requests, args.max_tokens)
    longest = max(len(p) for p in requests) + args.max_tokens
    blocks = 2 * (-(-longest // 16))  # two of the longest requests at once: the batch must preempt
    with engine(path, deterministic, args, max_num_batched_tokens=512, num_gpu_blocks_override=blocks,
                max_model_len=longest) as llm:
        runs["chunked_512_preempted"] = outputs_of(llm, requests, args.max_tokens)
        preemptions = llm._core.scheduler.num_preemptions_total
    assert hits > 0 and preemptions > 0, f"prefix hits {hits}, preemptions {preemptions}: a way was not exercised"
    fractions = {way: float(np.mean([same(a, b) for a, b in zip(alone, run, strict=True)])) for way, run in runs.items()}
    tokens = {way: float(np.mean([a[0] == b[0] for a, b in zip(alone, run, strict=True)])) for way, run in runs.items()}
    log(f"deterministic={deterministic}: bitwise " + ", ".join(f"{w} {f:.3f}" for w, f in fractions.items())
        + "; tokens " + ", ".join(f"{w} {f:.3f}" for w, f in tokens.items()))
    return fractions, tokens


def throughput(llm, args) -> float:
    """Output tokens/s of the sharegpt-like mixed workload (as `jengine bench throughput`)."""
    from jengine import SamplingParams
    from jengine.bench.datasets import sharegpt_like_dataset

    requests = sharegpt_like_dataset(np.arange(3, 500), args.mixed, 256, 128, seed=0, max_total_len=1024)
    batch = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(max_tokens=r.expected_output_len, ignore_eos=True, temperature=1.0, seed=i)
              for i, r in enumerate(requests)]
    llm.generate(batch[:32], params[:32], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def decode_step_ms(llm, args, batch: int, prompt_len: int = 128) -> float:
    """A decode step's time at `batch` requests of `prompt_len`-token prompts: the difference of two runs' times ÷
    the extra steps."""
    rng = np.random.default_rng(batch)
    requests = prompts(rng, batch, 500, prompt_len, prompt_len + 1)
    timings = []
    for tokens in (8, 8 + args.step_tokens):
        outputs_of(llm, requests, tokens)  # compiles this run's shapes
        runs = []
        for _ in range(3):  # the fastest of three: host noise only ever adds
            start = time.perf_counter()
            outputs_of(llm, requests, tokens)
            runs.append(time.perf_counter() - start)
        timings.append(min(runs))
    return 1000 * (timings[1] - timings[0]) / args.step_tokens


def cost(path: Path, deterministic: bool, args, name: str) -> dict[str, float]:
    """Decode steps at batch 1 and 64 and the mixed workload, on one engine with every bucket compiled first and
    no prefix cache (each timed run the same shapes)."""
    compile_buckets = "lazy" if args.tiny else "all"  # every CPU bucket compiled would take minutes
    with engine(path, deterministic, args, compile_buckets=compile_buckets, enable_prefix_caching=False) as llm:
        out = {f"decode_b{batch}_{name}_ms": decode_step_ms(llm, args, batch) for batch in (1, 64)}
        if args.mixed:
            out[f"mixed_tokens_per_s_{name}"] = throughput(llm, args)
    log(out)
    return out


def long_context(path: Path, deterministic: bool, args, name: str) -> dict[str, float]:
    """Decode steps at batch 1 and 8 after prompts of each `--long-context` length: the deterministic engine sends
    every request through one attention kernel, without the decode kernel's split of a long context over the SMs,
    so few long requests are where it costs most."""
    out = {}
    with engine(path, deterministic, args, max_model_len=max(args.long_context) + 8 + args.step_tokens,
                max_num_seqs=8, enable_prefix_caching=False) as llm:
        for n in args.long_context:
            out |= {f"decode_b{batch}_ctx{n}_{name}_ms": decode_step_ms(llm, args, batch, n) for batch in (1, 8)}
    log(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory of the results file")
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--moe", action="store_true", help="the Qwen3-30B-A3B shape instead of Llama-3.1-8B's")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--mixed", type=int, default=1000, help="requests of the throughput workload (0: skip)")
    parser.add_argument("--step-tokens", type=int, default=64)
    parser.add_argument("--workdir", default="/tmp/jengine-determinism")
    parser.add_argument("--parts", default="ways,cost", help="ways (the bitwise checks), cost (the timings), long "
                        "(decode at batch 1 and 8 after --long-context-token prompts)")
    parser.add_argument("--long-context", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--modes", default="deterministic,fast", help="the engines each part runs")
    parser.add_argument("--invariant-segment", type=int, default=None,
                        help="the deterministic engines' attention in long-context segments of at least this many "
                             "positions (0: one split; default: the engine's)")
    args = parser.parse_args()
    if args.invariant_segment is not None:
        from jengine.attention import backend

        backend.INVARIANT_SEGMENT = args.invariant_segment or None  # static in the backend: the programs key on it
    if args.tiny:
        args.requests, args.mixed, args.max_tokens, args.step_tokens = 6, 24, 8, 8
        args.long_context = [128, 256]
    path = model_dir(args)
    rng = np.random.default_rng(0)
    vocab = min(json.loads((path / "config.json").read_text())["vocab_size"],  # the MoE shapes' tokenizer is
                len(json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]))  # smaller than the model's
    high = 60 if args.tiny else 700
    requests = prompts(rng, args.requests, vocab, 20, high)
    neighbours = prompts(rng, 3 * args.requests, vocab, 1, high)
    metrics: dict[str, Any] = {"layers": args.layers, "requests": args.requests, "max_tokens": args.max_tokens,
                               "invariant_segment": args.invariant_segment}
    ratios: dict[str, float] = {}
    if "ways" in args.parts:
        modes = [(d, name) for d, name, mode in ((True, "gpu", "deterministic"), (False, "fast", "fast"))
                 if mode in args.modes.split(",")]
        for deterministic, name in modes:
            fractions, tokens = ways(path, deterministic, args, requests, neighbours)
            metrics[f"{name}_identical_by_way"], metrics[f"{name}_tokens_identical_by_way"] = fractions, tokens
            ratios[f"{name}_bitwise_identical_fraction"] = float(np.mean(list(fractions.values())))
    if "cost" in args.parts:
        for deterministic, name in ((False, "fast"), (True, "deterministic")):
            if name in args.modes.split(","):
                metrics |= cost(path, deterministic, args, name)
    if "long" in args.parts:
        for deterministic, name in ((False, "fast"), (True, "deterministic")):
            if name in args.modes.split(","):
                metrics |= long_context(path, deterministic, args, name)
    record = common.result_record("determinism", args.git_sha, common.jax_device_name(), common.versions(),
                                  " ".join(["python", *sys.argv]), metrics, ratios,
                                  shape="Qwen3-30B-A3B" if args.moe else "tiny" if args.tiny else "Llama-3.1-8B layers")
    shape = ("-moe" if args.moe else "-cpu" if args.tiny else "") + (
        f"-segment{args.invariant_segment}" if args.invariant_segment else "")
    out = Path(args.out) / f"{time.strftime('%Y-%m-%d')}{shape}-determinism.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():  # another part's call at the same commit
        record = common.merge_records(common.read_record(out), record)
    both = [record["metrics"].get(f"mixed_tokens_per_s_{name}") for name in ("deterministic", "fast")]
    if all(both):  # the two engines' throughputs, from this call or an earlier one merged in
        record["ratios"]["deterministic_throughput_vs_fast"] = both[0] / both[1]
    for key in (f"decode_b{batch}_ctx{n}" for n in args.long_context for batch in (1, 8)):  # where both ran
        steps = [record["metrics"].get(f"{key}_{name}_ms") for name in ("deterministic", "fast")]
        if all(steps):
            record["ratios"][f"deterministic_{key}_vs_fast"] = steps[0] / steps[1]
    common.write_record(out, record)
    common.print_tables(record)


if __name__ == "__main__":
    main()
