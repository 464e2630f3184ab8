"""Which output tile and K step should the batch-invariant matmul use at each row count? Bits and time.

The invariant matmul never splits K, so its output tile, K step, warps and stages only decide which program
computes an output and how much of K a loop step loads, not the order of a row's additions
(`pallas_kernels/invariant_matmul`). This probe checks that on the GPU for every candidate and times the candidates,
to choose `tile_for`'s tiles.

For each of Llama-3.1-8B's projections and its LM head, at each row count: µs per call of XLA's dot (cuBLAS, the
peer), of the default invariant matmul, and of each candidate tile; each timed as `--calls`-weight chains inside
one program (distinct weights, so the L2 cannot hold them; no host dispatch in the time). Bits: every candidate's
rows against `TILE`'s result at 4,096 rows (the same rows at the top). Results are written after every projection,
so a call that runs out of time keeps what it measured.

    PYTHONPATH=. python scripts/probe_invariant_tiles_gpu.py --out $OUT --git-sha <sha>
    PYTHONPATH=. python scripts/probe_invariant_tiles_gpu.py --tiny --out /tmp/probe     # CPU: paths only
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
from probe_invariance_gpu import LLAMA_8B_WEIGHTS, rows_equal  # noqa: E402

# (block_m, block_n, block_k, num_warps, num_stages) candidates, by row count class
DECODE = [(64, 32, 64, 4, 4), (16, 32, 256, 4, 4), (16, 64, 256, 4, 4), (16, 32, 128, 4, 6), (16, 16, 256, 4, 6),
          (64, 32, 256, 4, 3), (64, 64, 128, 4, 4), (32, 64, 256, 4, 4)]
MIDDLE = [(64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 128, 4, 3),
          (64, 128, 64, 4, 4), (64, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 256, 64, 8, 3), (128, 64, 128, 8, 3),
          (128, 128, 64, 8, 4), (64, 256, 64, 4, 4), (128, 256, 64, 8, 3), (128, 256, 32, 8, 4), (128, 256, 64, 8, 4)]
# (four stages of 128 × 256 × 64 fit a Hopper SM's shared memory since the budget follows the device: 192 KiB)
PREFILL = [(128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (128, 256, 128, 8, 2), (256, 128, 64, 8, 3),
           (128, 256, 64, 8, 4), (128, 128, 64, 8, 4)]
# `--transposed-too`: the same weight stored `[n, k]` (as the LM head is), whose rows are contiguous along K, so narrow
# column tiles still load whole lines: enough programs for every SM at decode sizes (q/k/v: 96 tiles of 64 columns)
DECODE_TRANSPOSED = [(16, 16, 256, 4, 4), (16, 16, 512, 4, 3), (16, 16, 256, 2, 4), (16, 32, 256, 4, 4),
                     (16, 32, 512, 4, 3), (16, 64, 256, 4, 4)]


def candidates(rows: int) -> list[tuple[int, int, int, int]]:
    return DECODE if rows <= 64 else MIDDLE if rows <= 1024 else PREFILL


def weights(k: int, n: int, transposed: bool, count: int):
    import jax
    import jax.numpy as jnp

    shape = (n, k) if transposed else (k, n)
    return [(jax.random.normal(jax.random.key(k + n + i), shape, jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
            for i in range(count)]


def chain(matmul):
    """One program calling `matmul` on each weight in turn (the sum keeps every call live)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(x, ws):
        return sum(jnp.sum(matmul(x, w)[:, :8].astype(jnp.float32)) for w in ws)

    return run


def probe_shape(name: str, k: int, n: int, transposed: bool, args) -> dict:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.invariant_matmul import TILE, invariant_matmul
    from pallas_kernels.invariant_matmul.kernel import Tile

    count = 1 if args.tiny else max(2, min(args.calls, int(4e8 // (2 * k * n))))
    ws = weights(k, n, transposed, count)
    top = 48 if args.tiny else 4096
    x_all = jax.random.normal(jax.random.key(1), (top, k), jnp.bfloat16)
    dims = (((1,), (1 if transposed else 0,)), ((), ()))
    interp = args.tiny

    def ours(tile=None):
        return lambda x, w: invariant_matmul(x, w, transposed=transposed, interpret=interp, tile=tile)

    reference = ours(TILE)(x_all, ws[0])
    per_call = lambda fn, x: 1e6 * timeit(chain(fn), x, ws, runs=3) / count  # noqa: E731
    out: dict = {"weights_chained": count}
    for rows in ((1, 8, 40) if args.tiny else args.rows):
        x = x_all[:rows]
        entry = {"xla_us": per_call(lambda a, w: jax.lax.dot_general(a, w, dims), x), "default_us": per_call(ours(), x),
                 "default_same_bits": rows_equal(ours()(x, ws[0]), reference)}
        for block_m, block_n, block_k, warps, stages in ([] if args.default_only else candidates(rows)):
            key = f"m{block_m}_n{block_n}_k{block_k}_w{warps}_s{stages}"
            tile = Tile(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)
            try:
                entry[f"{key}_same_bits"] = rows_equal(ours(tile)(x, ws[0]), reference)
                entry[f"{key}_us"] = per_call(ours(tile), x)
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile is reported, not fatal
                entry[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if args.transposed_too and not transposed and rows <= 64:
            entry.update(transposed_layout(x, ws, reference, per_call, interp))
        timed = {key[:-3]: value for key, value in entry.items() if key.endswith("_us") and key[0] == "m"}
        if timed:
            best = min(timed, key=timed.get)
            entry.update(best=best, best_vs_xla=entry["xla_us"] / timed[best],
                         default_vs_xla=entry["xla_us"] / entry["default_us"])
        out[str(rows)] = entry
        log({f"{name}_{rows}": entry})
    return out


def transposed_layout(x, ws, reference, per_call, interp: bool) -> dict:
    """The `DECODE_TRANSPOSED` tiles on each weight stored `[n, k]`: µs per call and whether a row keeps its bits."""
    import jax.numpy as jnp

    from pallas_kernels.invariant_matmul import invariant_matmul
    from pallas_kernels.invariant_matmul.kernel import Tile

    ws_t = [jnp.asarray(w.T) for w in ws]
    out = {}
    for block_m, block_n, block_k, warps, stages in DECODE_TRANSPOSED:
        key = f"t_m{block_m}_n{block_n}_k{block_k}_w{warps}_s{stages}"
        tile = Tile(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)

        def ours(a, w, tile=tile):
            return invariant_matmul(a, w, transposed=True, interpret=interp, tile=tile)

        try:
            out[f"{key}_same_bits"] = rows_equal(ours(x, ws_t[0]), reference)
            out[f"{key}_us"] = 1e6 * timeit(chain(ours), x, ws_t, runs=3) / len(ws_t) if not interp else 0.0
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile is reported, not fatal
            out[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--shapes", nargs="+", default=list(LLAMA_8B_WEIGHTS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--default-only", action="store_true", help="no candidates: the default tile and XLA's dot")
    parser.add_argument("--calls", type=int, default=8, help="most weights chained per timed program")
    parser.add_argument("--transposed-too", action="store_true",
                        help="also each [k, n] weight stored [n, k], with narrow decode tiles (rows <= 64)")
    args = parser.parse_args()
    import jax

    record = {"git_sha": args.git_sha, "device": jax.devices()[0].device_kind, "shapes": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes:
        k, n, transposed = (96, 80, name == "lm_head") if args.tiny else LLAMA_8B_WEIGHTS[name]
        record["shapes"][name] = probe_shape(name, k, n, transposed, args)
        (out / f"invariant_tiles_{args.git_sha}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
