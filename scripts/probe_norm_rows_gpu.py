"""The batch-invariant RMSNorm rows walked in straight-line code against the loop: bits and time on the GPU.

`add_rms_norm_rows` (the residual add fused into the norm, twice a decode layer) runs one program a row and, walked
in a loop, waits for each chunk of its row twice. Straight-line code puts all of a row's loads in flight at once
(`rows.MAX_UNROLLED_CHUNKS`). For each width and row count: µs per call of each walk, timed as a dependent chain of
`--chain` calls inside one program (as a step's layers call it: no host dispatch in the time), and whether the two
walks give the same bits (both outputs, fresh bf16 inputs).

    PYTHONPATH=. python scripts/probe_norm_rows_gpu.py --out $OUT --git-sha <sha>
    PYTHONPATH=. python scripts/probe_norm_rows_gpu.py --tiny --out /tmp/probe     # CPU: paths only
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
from pallas_kernels.invariant_matmul.rows import MAX_UNROLLED_CHUNKS  # noqa: E402


def chained(max_unrolled_chunks: int, links: int, interpret: bool):
    """`links` fused add-norms, each one's (sum, normed) the next one's (x, delta)."""
    import jax

    from pallas_kernels.invariant_matmul.rows import add_rms_norm_rows

    @jax.jit
    def run(x, delta, w):
        for _ in range(links):
            x, delta = add_rms_norm_rows(x, delta, w, eps=1e-5, interpret=interpret,
                                         max_unrolled_chunks=max_unrolled_chunks)
        return x, delta

    return run


def probe(width: int, rows: int, args) -> dict:
    import jax
    import jax.numpy as jnp

    key = jax.random.key(width * 1000 + rows)
    x, delta = (jax.random.normal(k, (rows, width), jnp.float32).astype(jnp.bfloat16)
                for k in jax.random.split(key))
    w = (1 + 0.1 * jax.random.normal(key, (width,), jnp.float32)).astype(jnp.bfloat16)
    walks = {"unrolled": chained(MAX_UNROLLED_CHUNKS, args.chain, args.tiny), "loop": chained(0, args.chain, args.tiny)}
    outs = {name: run(x, delta, w) for name, run in walks.items()}
    same = all(np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
               for a, b in zip(outs["unrolled"], outs["loop"], strict=True))
    result = {"bits_equal": same}
    for name, run in walks.items():
        result[f"{name}_us"] = timeit(run, x, delta, w, runs=3 if args.tiny else 7) / args.chain * 1e6
    result["loop_over_unrolled"] = result["loop_us"] / result["unrolled_us"]
    log(f"width {width} rows {rows}: " + ", ".join(
        f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--widths", type=int, nargs="+", default=[2048, 4096, 5120, 8192])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--chain", type=int, default=64, help="dependent calls per timed program (a step's 64)")
    args = parser.parse_args()
    import jax

    if args.tiny:
        args.widths, args.rows, args.chain = [700, 2048], [1, 3], 2
    record = {"git_sha": args.git_sha, "device": jax.devices()[0].device_kind, "chain": args.chain, "probes": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for width in args.widths:
        for rows in args.rows:
            record["probes"][f"w{width}_r{rows}"] = probe(width, rows, args)
            (out / f"norm_rows_{args.git_sha}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
