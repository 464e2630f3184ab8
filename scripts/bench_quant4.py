"""GPU check-and-bench of the W4A16 matmul (pallas_kernels/w4a16) against bfloat16 XLA dots, on the projections of a
Llama-3.1-8B-shaped model (8 of its 32 layers, 0.9 GB at 4 bits, far beyond L2: fused q/k/v, o, fused
gate/up, down; random weights, group 128).

Two levels, both sides of every ratio timed in this one call, correctness checked first:
- model level (the issue's `ratios.w4a16_*` keys; `scripts/quant4_model_bench.py`): the engine's decode step at
  batch 1 and 64 and a prefill chunk of the whole 32-layer model, its projections `Int4Weight`s through `linear()`
  and the Pallas kernel, against the same step with bfloat16 projections; the floor adds the KV bytes;
- projection level (`ratios.projection_w4a16_*`): the step's projections alone (no attention, no KV), 8 layers of
  their own weights (far beyond L2) read once per step, per tile. The decode floor is the bytes the 4-bit
  projections must read (words + zero points + scales) ÷ the measured device-to-device copy rate.

    PYTHONPATH=. python scripts/bench_quant4.py --out $OUT/quant4.json --git-sha <sha>
    PYTHONPATH=. python scripts/bench_quant4.py --tiny --out /tmp/quant4.json     # shape check on the CPU
    PYTHONPATH=. python scripts/bench_quant4.py --out $OUT/quant4.json --gguf /tmp/gguf-scratch   # + GGUF load time
      (the GPU machine has no gguf package: install its wheel first, e.g. from /work/wt/wheels/quant4/)
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_bench_common as common  # noqa: E402
from gpu_bench_common import log  # noqa: E402

GROUP = 128
LLAMA_31_8B = dict(layers=8, shapes=((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)))
TINY = dict(layers=2, shapes=((256, 384), (256, 256), (256, 1024), (512, 256)))
DECODE_TILES = ((16, 32), (16, 64), (16, 128))  # (block_m, block_n) tried for decode; the fastest is reported
PREFILL_TILES = ((64, 128), (128, 128), (64, 64))


def make_weights(shape_set: dict):
    """Per layer and projection: (bf16 weight [k, n], packed int32 [k/8, n], zeros, scales), built on the device."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.w4a16.reference import unpack

    layers = []
    key = jax.random.key(0)
    for _ in range(shape_set["layers"]):
        mats = []
        for k, n in shape_set["shapes"]:
            key, a, b, c = jax.random.split(key, 4)
            packed = jax.random.randint(a, (k // 8, n), jnp.iinfo(jnp.int32).min, jnp.iinfo(jnp.int32).max, jnp.int32)
            zeros = jax.random.randint(b, (k // GROUP, n), 0, 16).astype(jnp.bfloat16)
            scales = (jax.random.uniform(c, (k // GROUP, n)) * 0.01).astype(jnp.bfloat16)
            rows = jnp.arange(k) // GROUP
            dense = ((unpack(packed) - zeros[rows].astype(jnp.float32)) * scales[rows].astype(jnp.float32))
            mats.append((dense.astype(jnp.bfloat16), packed, zeros, scales))
        layers.append(mats)
    return layers


def step_fns(layers, interpret: bool):
    """(bf16 step, w4a16 step factory by tile): every projection of every layer on one activation per input width."""
    import jax

    from pallas_kernels.w4a16 import w4a16_matmul

    @jax.jit
    def bf16_step(xs, weights):
        return [x_for(xs, w.shape[0]) @ w for w in weights]

    def w4_step(block_m: int, block_n: int):
        fn = functools.partial(w4a16_matmul, group=GROUP, block_m=block_m, block_n=block_n, interpret=interpret)

        @jax.jit
        def step(xs, quantized):
            return [fn(x_for(xs, p.shape[0] * 8), p, z, s) for p, z, s in quantized]
        return step

    return bf16_step, w4_step


def x_for(xs: dict, k: int):
    return xs[k]


def check(layers, rows: int, tiles, interpret: bool) -> float:
    """Max relative error of the kernel against the reference on layer 0, every tile."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.w4a16 import w4a16_matmul, w4a16_matmul_reference

    worst = 0.0
    for dense, packed, zeros, scales in layers[0]:
        x = jax.random.normal(jax.random.key(3), (rows, dense.shape[0]), jnp.bfloat16)
        ref = np.asarray(w4a16_matmul_reference(x, packed, zeros, scales, group=GROUP), np.float32)
        for block_m, block_n in tiles:
            out = np.asarray(w4a16_matmul(x, packed, zeros, scales, group=GROUP, block_m=block_m, block_n=block_n,
                                          interpret=interpret), np.float32)
            worst = max(worst, float(np.abs(out - ref).max() / np.abs(ref).max()))
    return worst


def time_case(layers, rows: int, tiles, interpret: bool) -> tuple[float, float, tuple[int, int]]:
    """(bf16 seconds, best w4a16 seconds, its tile) for one step of `rows` tokens."""
    import jax
    import jax.numpy as jnp

    bf16_step, w4_step = step_fns(layers, interpret)
    widths = sorted({m[0].shape[0] for m in layers[0]})
    xs = {k: jax.random.normal(jax.random.key(k), (rows, k), jnp.bfloat16) for k in widths}
    dense = [m[0] for layer in layers for m in layer]
    quantized = [m[1:] for layer in layers for m in layer]
    t_bf16 = common.timeit(bf16_step, xs, dense)
    best = min(((common.timeit(w4_step(*tile), xs, quantized), tile) for tile in tiles))
    return t_bf16, best[0], best[1]


def gguf_load(scratch: Path) -> float:
    """Seconds from `LLM(FILE.gguf)` to its first token, on a freshly written 8B-shaped Q4_K file."""
    from gguf_load_bench import load_to_first_token_seconds, write_q4k_file

    from jengine.tokenizer.tiny import train_tiny_tokenizer

    scratch.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    path = write_q4k_file(scratch / "llama-8b-shaped-Q4_K.gguf")
    log(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s")
    seconds = load_to_first_token_seconds(path, train_tiny_tokenizer(scratch / "tokenizer", vocab_size=512))
    log(f"GGUF Q4_K load to the first token: {seconds:.1f} s")
    path.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--tiny", action="store_true", help="small shapes, interpret mode (CPU shape check)")
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--context", type=int, default=1024, help="tokens in the cache at the model decode steps")
    parser.add_argument("--no-model", action="store_true", help="projection level only")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="a scratch directory: also write an 8B-shaped Q4_K GGUF file there and time its load to "
                             "the first token (needs the gguf package; ~5 GB of disk)")
    args = parser.parse_args()
    import jax

    gguf_seconds = gguf_load(args.gguf) if args.gguf else None

    interpret = args.tiny or jax.devices()[0].platform != "gpu"
    shape_set = TINY if args.tiny else LLAMA_31_8B
    layers = make_weights(shape_set)
    prefill = 64 if args.tiny else args.prefill
    errors = {rows: check(layers, rows, DECODE_TILES if rows <= 64 else PREFILL_TILES, interpret)
              for rows in (1, 64, prefill)}
    log("max relative error vs the reference:", errors)
    assert all(e <= 2e-2 for e in errors.values()), errors
    metrics, ratios = {"max_rel_error": {str(k): v for k, v in errors.items()}}, {}
    quant_bytes = sum(p.nbytes + z.nbytes + s.nbytes for layer in layers for _, p, z, s in layer)
    _, copy_rate = common.copy_bandwidth(1 << 24 if args.tiny else 1 << 30)
    floor = quant_bytes / copy_rate
    metrics.update(w4a16_bytes=quant_bytes, copy_bytes_per_s=copy_rate, decode_floor_s=floor)
    for rows, name, tiles in ((1, "decode_b1", DECODE_TILES), (64, "decode_b64", DECODE_TILES[:2] + ((64, 128),)),
                              (prefill, "prefill", PREFILL_TILES)):
        t_bf16, t_w4, tile = time_case(layers, rows, tiles, interpret)
        metrics.update({f"{name}_bf16_s": t_bf16, f"{name}_w4a16_s": t_w4, f"{name}_w4a16_tile": list(tile)})
        ratios[f"projection_w4a16_{name}_vs_bf16"] = t_bf16 / t_w4
        log(f"{name}: bf16 {t_bf16 * 1e3:.3f} ms, w4a16 {t_w4 * 1e3:.3f} ms (tile {tile})")
    ratios["projection_w4a16_decode_b1_vs_floor"] = metrics["decode_b1_w4a16_s"] / floor
    if not args.no_model:
        from bench_quant8 import LLAMA_31_8B as MODEL_8B, TINY as MODEL_TINY
        from quant4_model_bench import model_level

        model_metrics, model_ratios = model_level(MODEL_TINY if args.tiny else MODEL_8B, args.tiny,
                                                  32 if args.tiny else args.context, prefill, copy_rate)
        metrics.update(model_metrics)
        ratios.update(model_ratios)
    metrics["gguf_q4k_load_seconds"] = gguf_seconds  # None unless --gguf
    record = common.result_record(
        "quant4", args.git_sha, common.jax_device_name(), common.versions(), " ".join(sys.argv), metrics, ratios,
        notes="w4a16_*: the model step (32 Llama-3.1-8B layers, Int4Weight projections through the Pallas kernel; "
              "the floor holds the KV bytes); projection_w4a16_*: 8 layers of q/k/v, o, gate/up, down alone (no "
              "attention or KV bytes in the floor); ratios vs bf16 are bf16 time ÷ w4a16 time (higher is better); "
              "vs_floor is w4a16 time ÷ floor (lower is better)")
    common.write_record(args.out, record)
    common.print_tables(record)


if __name__ == "__main__":
    main()
