"""The batch-invariant gated MLP's gate/up with its activation in the same launch, against the two launches it
replaces: bits and time on the GPU.

`gated_invariant_matmul` computes act(x @ gate) · (x @ up) for the fused `[gate | up]` weight (Llama-3.1-8B's:
4,096 × 2 · 14,336) and never writes the `[rows, 2 · 14,336]` product; the unfused path is `invariant_matmul`, then
XLA's silu and product. For each row count: µs per call of each, timed as `--chain` independent weights inside one
program (as a step's layers read theirs: no host dispatch, no weight left in L2), and whether the fused output
equals the unfused gate and up sums activated with the same roundings (float32 sums rounded to bf16, the silu in
float32 rounded once, the product rounded).

    PYTHONPATH=. python scripts/probe_gated_mlp_gpu.py --out $OUT --git-sha <sha>
    PYTHONPATH=. python scripts/probe_gated_mlp_gpu.py --tiny --out /tmp/probe     # CPU: paths only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench_common import log, timeit  # noqa: E402


def programs(calls: int, interpret: bool):
    """(fused, unfused): each runs `calls` weights on x, one after another in one program."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.invariant_matmul import gated_invariant_matmul, invariant_matmul

    def unfused_one(x, w):
        gate, up = jnp.split(invariant_matmul(x, w, interpret=interpret), 2, axis=-1)
        return (jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype).astype(jnp.float32)
                * up.astype(jnp.float32)).astype(x.dtype)

    def fused_one(x, w):
        return gated_invariant_matmul(x, w, interpret=interpret)

    def chain(one):
        @jax.jit
        def run(x, ws):
            return [one(x, ws[i]) for i in range(calls)]
        return run

    return chain(fused_one), chain(unfused_one)


def probe(rows: int, weights, args) -> dict:
    import jax
    import jax.numpy as jnp

    k = weights.shape[1]
    x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.float32).astype(jnp.bfloat16)
    fused, unfused = programs(weights.shape[0], args.tiny)
    a, b = fused(x, weights)[0], unfused(x, weights)[0]
    result = {"bits_equal": bool(np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))),
              "mismatched_fraction": float(np.mean(np.asarray(a) != np.asarray(b)))}
    for name, run in (("fused", fused), ("unfused", unfused)):
        result[f"{name}_us"] = timeit(run, x, weights, runs=3 if args.tiny else 7) / weights.shape[0] * 1e6
    result["unfused_over_fused"] = result["unfused_us"] / result["fused_us"]
    log(f"rows {rows}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in result.items()))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=14336)
    parser.add_argument("--calls", type=int, default=4, help="independent weights per timed program")
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp

    if args.tiny:
        args.rows, args.hidden, args.inter, args.calls = [1, 3], 96, 200, 2
    weights = (0.02 * jax.random.normal(jax.random.key(0), (args.calls, args.hidden, 2 * args.inter),
                                        jnp.float32)).astype(jnp.bfloat16)
    record = {"git_sha": args.git_sha, "device": jax.devices()[0].device_kind, "hidden": args.hidden,
              "inter": args.inter, "calls": args.calls, "probes": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for rows in args.rows:
        record["probes"][f"rows{rows}"] = probe(rows, weights, args)
        (out / f"gated_mlp_{args.git_sha}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
