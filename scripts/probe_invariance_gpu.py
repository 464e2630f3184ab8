"""Where does a request's output come to depend on its batch on the GPU? Each piece of the step checked alone.

Pieces, each as "the first rows alone" against "the same rows at the top of a larger batch", bitwise:
the batch-invariant matmul (`pallas_kernels/invariant_matmul`) at 16 vs 256 rows, XLA's plain dot the same way (the
fast engine's projections), RMSNorm, log-softmax over a 128k vocabulary at 16 vs 64 rows, the sampler's top-p filter
(both ways) at 16 vs 256 rows; then the whole
`deterministic=True` engine: `--requests` greedy requests alone against batched with random neighbours, with the first
generated position at which each one's top-5 logprobs differ (0: the prefill's token). Run it once per XLA flag set
to compare (e.g. with `XLA_FLAGS=--xla_allow_excess_precision=false`); `--name` keys the results. `--matmul-cost`
adds, for each of Llama-3.1-8B's projections and its LM head at 1–4096 rows, the invariant matmul's time beside
XLA's dot (cuBLAS) and the weight's bytes floor at `--bandwidth` B/s (`probe_invariant_tiles_gpu.py` compares the
matmul's candidate tiles).

    PYTHONPATH=. python scripts/probe_invariance_gpu.py --out $OUT --name default --git-sha <sha>
    PYTHONPATH=. python scripts/probe_invariance_gpu.py --tiny --out /tmp/probe --name cpu     # CPU: paths only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import check_determinism_gpu as det  # noqa: E402
from gpu_bench_common import log  # noqa: E402


def rows_equal(small, large) -> bool:
    small, large = np.asarray(small), np.asarray(large)
    return bool(np.array_equal(small.view(np.uint8), large[: small.shape[0]].view(np.uint8)))


def pieces(args) -> dict[str, bool]:
    import jax
    import jax.numpy as jnp

    from jengine.layers.norm import rms_norm
    from pallas_kernels.invariant_matmul import invariant_matmul
    from pallas_kernels.invariant_matmul.rows import log_softmax_rows, rms_norm_rows

    k, n, vocab = (64, 96, 512) if args.tiny else (4096, 6144, 128256)
    key = iter(jax.random.split(jax.random.key(0), 8))
    x = jax.random.normal(next(key), (256, k), jnp.bfloat16)
    w = (jax.random.normal(next(key), (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    head = (jax.random.normal(next(key), (vocab, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    norm_w = jax.random.normal(next(key), (k,), jnp.bfloat16)
    interpret = args.tiny
    inv = lambda a: invariant_matmul(a, w, interpret=interpret)  # noqa: E731
    inv_head = lambda a: invariant_matmul(a, head, transposed=True, out_dtype=jnp.float32,  # noqa: E731
                                          interpret=interpret)
    dot = jax.jit(lambda a: jnp.dot(a, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    norm = jax.jit(lambda a: rms_norm(a, norm_w, 1e-5))
    logits = jax.random.normal(next(key), (64, vocab), jnp.float32) * 4
    lsm = jax.jit(lambda a: jax.nn.log_softmax(a, axis=-1))
    inv_norm = jax.jit(lambda a: rms_norm_rows(a, norm_w, eps=1e-5, interpret=interpret))
    inv_lsm = jax.jit(lambda a: log_softmax_rows(a, interpret=interpret))
    top_p = top_p_filter(logits=jax.random.normal(next(key), (256, vocab), jnp.float32) * 4, tiny=args.tiny)
    out = {}
    for rows in (1, 16, 64):
        out[f"top_p_{rows}_vs_256"] = rows_equal(top_p(rows, "xla"), top_p(256, "xla"))
        out[f"invariant_top_p_{rows}_vs_256"] = rows_equal(top_p(rows, "pallas"), top_p(256, "pallas"))
        out[f"invariant_matmul_{rows}_vs_256"] = rows_equal(inv(x[:rows]), inv(x))
        out[f"invariant_head_{rows}_vs_256"] = rows_equal(inv_head(x[:rows]), inv_head(x))
        out[f"xla_dot_{rows}_vs_256"] = rows_equal(dot(x[:rows]), dot(x))
        out[f"rms_norm_{rows}_vs_256"] = rows_equal(norm(x[:rows]), norm(x))
        out[f"log_softmax_{rows}_vs_64"] = rows_equal(lsm(logits[:rows]), lsm(logits))
        out[f"invariant_rms_norm_{rows}_vs_256"] = rows_equal(inv_norm(x[:rows]), inv_norm(x))
        out[f"invariant_log_softmax_{rows}_vs_64"] = rows_equal(inv_lsm(logits[:rows]), inv_lsm(logits))
    log(out)
    return out


LLAMA_8B_WEIGHTS = {"qkv": (4096, 6144, False), "o": (4096, 4096, False), "gate_up": (4096, 28672, False),
                    "down": (14336, 4096, False), "lm_head": (4096, 128256, True)}  # (k, n, transposed)


def projection_weights(args):
    """(name, k, transposed, random bf16 weight) of each projection the matmul probes time (one tiny one --tiny)."""
    import jax
    import jax.numpy as jnp

    shapes = {"tiny": (640, 96, False)} if args.tiny else LLAMA_8B_WEIGHTS
    for name, (k, n, transposed) in shapes.items():
        w = jax.random.normal(jax.random.key(k + n), (n, k) if transposed else (k, n), jnp.float32) / np.sqrt(k)
        yield name, k, transposed, w.astype(jnp.bfloat16)


def matmul_costs(args) -> dict:
    """µs per call of the invariant matmul (its default tile for the shape) and of XLA's dot, and the bytes floor."""
    import jax
    import jax.numpy as jnp

    from gpu_bench_common import timeit
    from pallas_kernels.invariant_matmul import invariant_matmul

    out: dict = {}
    for name, k, transposed, w in projection_weights(args):
        n = w.shape[0] if transposed else w.shape[1]
        dims = (((1,), (1 if transposed else 0,)), ((), ()))
        xla = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims))
        for rows in (1, 16, 64, 256, 4096):
            x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
            ours = timeit(lambda a, b: invariant_matmul(a, b, transposed=transposed, interpret=args.tiny), x, w)
            theirs = timeit(xla, x, w)
            floor = (w.nbytes + x.nbytes + 2 * rows * n) / args.bandwidth
            out[f"{name}_{rows}"] = {"invariant_us": 1e6 * ours, "xla_us": 1e6 * theirs, "floor_us": 1e6 * floor,
                                     "invariant_vs_xla": ours / theirs}
        log({key: value for key, value in out.items() if key.startswith(name)})
    return out


def top_p_filter(logits, tiny: bool):
    """rows, impl -> the first `rows` rows of `logits` filtered by top_p = 0.9 (the sampler's full-sort path)."""
    import dataclasses

    import jax

    from jengine.layers.invariant import RowReduction
    from jengine.sampling.metadata import RowInputs, build_sampling_metadata
    from jengine.sampling.params import SamplingParams
    from jengine.sampling.sampler import sampling_logits

    def run(rows: int, impl: str):
        batch = [RowInputs(SamplingParams(top_p=0.9, seed=i), [], [], 0) for i in range(rows)]
        impl = "pallas_interpret" if tiny and impl == "pallas" else impl
        md = dataclasses.replace(build_sampling_metadata(batch, rows), row_reduction=RowReduction(impl))
        return jax.jit(sampling_logits)(logits[:rows], md)

    return run


def first_difference(alone, batched) -> int | None:
    """The first generated position whose tokens or top-5 logprobs differ (None: identical)."""
    tokens_a, top_a = alone
    tokens_b, top_b = batched
    width = 2 * (det.TOP + 1)  # (id, logprob) pairs per position, the chosen token's among them at most once more
    for pos, (ta, tb) in enumerate(zip(tokens_a, tokens_b)):
        if ta != tb:
            return pos
    # positions hold a variable number of pairs (the chosen token may be in the top 5): compare as a whole, then by
    # prefix length to locate the first difference
    if np.array_equal(top_a.view(np.uint32), top_b.view(np.uint32)):
        return None
    diff = np.nonzero(top_a[: min(len(top_a), len(top_b))].view(np.uint32)
                      != top_b[: min(len(top_a), len(top_b))].view(np.uint32))[0]
    return int(diff[0] // width) if len(diff) else len(tokens_a)


def engine_check(args) -> dict:
    path = det.model_dir(args)
    rng = np.random.default_rng(1)
    vocab = det.TINY["vocab_size"] if args.tiny else det.LLAMA_8B_LAYERS["vocab_size"]
    requests = det.prompts(rng, args.requests, vocab, 20, 700)
    neighbours = det.prompts(rng, args.neighbours, vocab, 20, 700)
    with det.engine(path, True, args) as llm:
        alone = [det.outputs_of(llm, [p], args.max_tokens)[0] for p in requests]
        batched = det.outputs_of(llm, requests + neighbours, args.max_tokens)[: len(requests)]
        duo = [det.outputs_of(llm, [p, neighbours[0]], args.max_tokens)[0] for p in requests[:4]]
    first = [first_difference(a, b) for a, b in zip(alone, batched)]
    first_duo = [first_difference(a, b) for a, b in zip(alone, duo)]
    out = {"first_difference_batched": first, "first_difference_with_one_neighbour": first_duo,
           "identical_batched": float(np.mean([f is None for f in first]))}
    log(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True, help="key of this run (e.g. the XLA flags it ran under)")
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--neighbours", type=int, default=56)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--workdir", default="/tmp/jengine-determinism")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--matmul-cost", action="store_true")
    parser.add_argument("--bandwidth", type=float, default=4.0e12, help="copy bandwidth for the floor (B/s)")
    args = parser.parse_args()
    args.moe = False
    record = {"git_sha": args.git_sha, "xla_flags": os.environ.get("XLA_FLAGS", ""), "pieces": pieces(args)}
    if args.matmul_cost:
        record["matmul_cost"] = matmul_costs(args)
    if not args.skip_engine:
        record["engine"] = engine_check(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"invariance_probe_{args.name}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
