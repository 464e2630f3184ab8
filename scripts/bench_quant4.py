"""GPU check-and-bench of the W4A16 matmul (pallas_kernels/w4a16) against bfloat16 XLA dots, on the projections of a
Llama-3.1-8B-shaped model (8 of its 32 layers, 0.9 GB at 4 bits, far beyond L2: fused q/k/v, o, fused
gate/up, down; random weights, group 128).

Two levels, both sides of every ratio timed in this one call, correctness checked first:
- model level (the issue's `ratios.w4a16_*` keys; `scripts/quant4_model_bench.py`): the engine's decode step at
  batch 1 and 64 and a prefill chunk of the whole 32-layer model, its projections `Int4Weight`s through `linear()`
  and the Pallas kernel, against the same step with bfloat16 projections; the floor adds the KV bytes;
- projection level (`ratios.projection_w4a16_*`): the step's projections alone (no attention, no KV), 8 layers of
  their own weights (far beyond L2) read once per step, a few kernel configurations each (`quant4_sweep.py`'s
  quick list, plus the winners of an earlier `--sweep` given by `--configs`), every one checked against the
  reference first; the fastest goes on to the model level. The decode floor is the bytes the 4-bit projections
  must read (words + zero points + scales) ÷ the measured device-to-device copy rate.
- `--sweep`: the full configuration sweep instead (`quant4_sweep.py`, ~4 min on the H200), then the model level
  with its winners.

    PYTHONPATH=. python scripts/bench_quant4.py --out $OUT/quant4.json --git-sha <sha>
    PYTHONPATH=. python scripts/bench_quant4.py --sweep --out $OUT/quant4.json --git-sha <sha>
    PYTHONPATH=. python scripts/bench_quant4.py --tiny --out /tmp/quant4.json     # shape check on the CPU
    PYTHONPATH=. python scripts/bench_quant4.py --out $OUT/quant4-g32.json --group 32 --git-sha <sha>  # GPTQ 32g
    PYTHONPATH=. python scripts/bench_quant4.py --out $OUT/quant4.json --gguf /tmp/gguf-scratch   # + GGUF load time
      (the GPU machine has no gguf package: install its wheel first, e.g. from /work/wt/wheels/quant4/)
"""

from __future__ import annotations

import argparse
import json
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


def projection_level(args, layers, interpret: bool) -> tuple[dict, dict, tuple]:
    """(metrics, ratios, Int4Weight.configs of the winners) of the projections alone, sweep or quick list."""
    from quant4_sweep import configs_from, sweep

    quant_bytes = sum(p.nbytes + z.nbytes + s.nbytes for layer in layers for _, p, z, s in layer)
    _, copy_rate = common.copy_bandwidth(1 << 24 if args.tiny else 1 << 30)
    floor = quant_bytes / copy_rate
    prefill = 64 if args.tiny else args.prefill
    rows = (1, 16, prefill) if args.tiny else (1, 64, prefill)
    extra = json.loads(Path(args.configs).read_text())["metrics"]["winners"] if args.configs else {}
    found = sweep(layers, rows, interpret, floor, args.sweep_budget, quick=not args.sweep, extra=extra)
    metrics = {"w4a16_bytes": quant_bytes, "copy_bytes_per_s": copy_rate, "decode_floor_s": floor, **found}
    ratios = {}
    for summary, name in zip(found["sweep"], ("decode_b1", "decode_b64", "prefill"), strict=True):
        best = summary.get("best")
        if best is None:
            log(f"{name}: no configuration ran correctly")
            continue
        metrics.update({f"{name}_bf16_s": summary["bf16_s"], f"{name}_w4a16_s": best["seconds"],
                        f"{name}_w4a16_config": best["label"]})
        ratios[f"projection_w4a16_{name}_vs_bf16"] = best["vs_bf16"]
    if "decode_b1_w4a16_s" in metrics:
        ratios["projection_w4a16_decode_b1_vs_floor"] = metrics["decode_b1_w4a16_s"] / floor
    return metrics, ratios, configs_from(found["winners"])


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--tiny", action="store_true", help="small shapes, interpret mode (CPU shape check)")
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--context", type=int, default=1024, help="tokens in the cache at the model decode steps")
    parser.add_argument("--no-model", action="store_true", help="projection level only")
    parser.add_argument("--group", type=int, default=GROUP, help="the model level's group size (32, 64: GPTQ's "
                        "small groups; keys then carry _g<group>)")
    parser.add_argument("--kernel", choices=("pallas", "mosaic", "both"), default="pallas",
                        help="the model level's 4-bit kernels: the Triton ones, the Mosaic weight-only one (keys "
                             "carry _mosaic), or both in turn")
    parser.add_argument("--mosaic-configs", default=None,
                        help="scripts/probe_weight_only_gpu.py's JSON: its fastest int4 configuration per row count "
                             "for the Mosaic kernel (default: the kernel's)")
    parser.add_argument("--sweep", action="store_true", help="the full configuration sweep (quant4_sweep.py)")
    parser.add_argument("--sweep-budget", type=float, default=200.0, help="seconds; later candidates are skipped")
    parser.add_argument("--configs", default=None, help="an earlier --sweep's JSON: its winners join the candidates")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="a scratch directory: also write an 8B-shaped Q4_K GGUF file there and time its load to "
                             "the first token (needs the gguf package; ~5 GB of disk)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import jax

    gguf_seconds = gguf_load(args.gguf) if args.gguf else None
    interpret = args.tiny or jax.devices()[0].platform != "gpu"
    layers = make_weights(TINY if args.tiny else LLAMA_31_8B)
    metrics, ratios, configs = projection_level(args, layers, interpret)
    del layers
    record = lambda: common.result_record(  # noqa: E731 - written twice: before and after the model level
        "quant4", args.git_sha, common.jax_device_name(), common.versions(), " ".join(sys.argv), metrics, ratios,
        notes="w4a16_*: the model step (32 Llama-3.1-8B layers, Int4Weight projections through the Pallas kernels "
              "at the projection level's winning configurations; the floor holds the KV bytes); projection_w4a16_*: "
              "8 layers of q/k/v, o, gate/up, down alone (no attention or KV bytes in the floor); ratios vs bf16 "
              "are bf16 time ÷ w4a16 time (higher is better); vs_floor is w4a16 time ÷ floor (lower is better)")
    common.write_record(args.out, record())  # the sweep survives a failing model level
    if not args.no_model:
        from bench_quant8 import LLAMA_31_8B as MODEL_8B, TINY as MODEL_TINY
        from quant4_model_bench import model_level

        kernels = ("pallas", "mosaic") if args.kernel == "both" else (args.kernel,)
        for kernel in kernels:
            model_metrics, model_ratios = model_level(MODEL_TINY if args.tiny else MODEL_8B, args.tiny,
                                                      32 if args.tiny else args.context,
                                                      64 if args.tiny else args.prefill, metrics["copy_bytes_per_s"],
                                                      configs=configs, group=args.group, kernel=kernel,
                                                      mosaic_configs=mosaic_configs(args.mosaic_configs))
            metrics.update(model_metrics)
            ratios.update(model_ratios)
            common.write_record(args.out, record())
    metrics["gguf_q4k_load_seconds"] = gguf_seconds  # None unless --gguf
    common.write_record(args.out, record())
    common.print_tables({**record(), "metrics": {k: v for k, v in metrics.items() if k != "sweep"}})


def mosaic_configs(path: str | None) -> tuple | None:
    """((up to rows, WeightOnlyConfig), ...) from the probe's `best.int4`, ascending; None without a file."""
    if not path:
        return None
    from pallas_kernels.weight_only.kernel import WeightOnlyConfig

    best = json.loads(Path(path).read_text()).get("best", {}).get("int4", {})
    return tuple((int(rows), WeightOnlyConfig(**entry["config"]))
                 for rows, entry in sorted(best.items(), key=lambda kv: int(kv[0])) if entry) or None


if __name__ == "__main__":
    main()
