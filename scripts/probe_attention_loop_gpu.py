"""GPU probe: the attention kernels' KV loop, read a step ahead, and a short step's tile rows; bits, then µs a call.

A prefix-cache hit's step (64 new tokens over a 2,112-token context) spent 1.52 ms of its 7.9 on the device in the
prefill kernel, 47 µs a layer (`results/2026-12-07-ttft-device-trace-0ac217c.txt`): 128 programs (16-row tiles × 8
KV heads), each walking 17 KV steps in a chain of two dependent loads a step (the block table's page ids, then K/V).
Variants of the deterministic engine's attention (`single_path`, 2,048-position segments, Llama-3.1-8B's heads,
bf16, pages of 16), each against the shipped tuning:
  prefetch        every kernel reads the next KV step's page ids during this one (`KernelConfig.prefetch_pages`)
  short<R>w<W>    a short step's prefill tiles of R rows and W warps (`Tuning.short_prefill`; 16 × 4 ships)
  ..._prefetch    both
and the default mode's decode with and without the prefetch. Shapes: the hit, 8 × 32 new tokens over 4k, decodes
at batch 1 and 64 over 576 positions, 64 over 4k and 256 over 1k. Each variant's rows are checked bit for bit
against the shipped tuning's (a variant that changes a bit is not a candidate: the engine's rows would then depend
on the step), then timed as CHAINED dependent calls inside one program, as a step's layers run them.

    PYTHONPATH=. python scripts/probe_attention_loop_gpu.py --out $OUT/attention-loop.json --git-sha <sha>
    PYTHONPATH=. python scripts/probe_attention_loop_gpu.py --smoke --out /tmp/loop.json   # CPU: paths and bits
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_invariant_attention_gpu import (HEAD_DIM, KV_HEADS, Q_HEADS, bits, chained_seconds,  # noqa: E402
                                           make_step, tuned_call)
from gpu_bench_common import log  # noqa: E402

CHAINED = 32  # calls a timed program makes, each on the last one's output (an 8B model's layers)
SEGMENT = 2048  # the engine's `invariant_segment` at max_model_len 4096
# (name, requests, new tokens each, context, bucket's max_query_len, block-table width in pages)
SHAPES = (("hit_q64_ctx2112", 1, 64, 2112, 64, 256), ("chunks_8x32_ctx4096", 8, 32, 4096, 32, 256),
          ("decode_b1_ctx576", 1, 1, 576, 1, 36), ("decode_b64_ctx576", 64, 1, 576, 1, 36),
          ("decode_b64_ctx4096", 64, 1, 4096, 1, 256), ("decode_b256_ctx1024", 256, 1, 1024, 1, 64))
SMOKE_SHAPES = (("hit_q16_ctx300", 1, 16, 300, 16, 24), ("decode_b2_ctx200", 2, 1, 200, 1, 16))


def tunings(segment: int) -> dict[str, tuple[Any, bool]]:
    """name: (tuning, single_path), the shipped ones first in each mode."""
    from pallas_kernels.ragged_paged_attention.tuning import KernelConfig, default_tuning

    base = dataclasses.replace(default_tuning(HEAD_DIM, Q_HEADS // KV_HEADS), invariant_segment=segment)

    def ahead(tuning):
        on = lambda cfg: None if cfg is None else dataclasses.replace(cfg, prefetch_pages=True)  # noqa: E731
        return dataclasses.replace(tuning, decode=on(tuning.decode), prefill=on(tuning.prefill),
                                   short_prefill=on(tuning.short_prefill))

    def short(rows: int, warps: int):
        return dataclasses.replace(base, short_prefill=KernelConfig(rows, base.prefill.block_n, warps, 2))

    ways = {"shipped": base, "prefetch": ahead(base)}
    for rows, warps in ((32, 4), (64, 4), (64, 8)):
        ways[f"short{rows}w{warps}"] = short(rows, warps)
        ways[f"short{rows}w{warps}_prefetch"] = ahead(short(rows, warps))
    out = {name: (t, True) for name, t in ways.items()}
    fast = default_tuning(HEAD_DIM, Q_HEADS // KV_HEADS)
    return out | {"fast_shipped": (fast, False), "fast_prefetch": (ahead(fast), False)}


def probe_shape(shape: tuple, ways: dict, smoke: bool) -> dict[str, float]:
    import jax

    name, requests, new, context, max_query_len, width = shape
    step = dataclasses.replace(make_step([new] * requests, [context] * requests, seed=context, width=width),
                               max_query_len=max_query_len)
    shipped = {}
    out: dict[str, float] = {}
    for way, (tuning, single_path) in ways.items():
        if (not single_path and new > 1) or (way.startswith("short") and new == 1):
            continue  # the default mode's variants are decode-only; a decode-only step has no short prefill tiles
        call = tuned_call(step, tuning, single_path=single_path, interpret=smoke)
        rows = bits(jax.jit(call)(step.q))
        shipped.setdefault(single_path, rows)
        out[f"{name}_{way}_same_bits"] = float(np.array_equal(rows, shipped[single_path]))
        if not smoke:
            out[f"{name}_{way}_us"] = chained_seconds(call, step.q, CHAINED) * 1e6
    log(name, {k.removeprefix(name + "_"): round(v, 2) for k, v in out.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--smoke", action="store_true", help="interpret mode on the CPU, small shapes, no timings")
    parser.add_argument("--only", nargs="*", default=None, help="shape names (default: all)")
    args = parser.parse_args()
    import jax

    ways = tunings(128 if args.smoke else SEGMENT)
    shapes = [s for s in (SMOKE_SHAPES if args.smoke else SHAPES) if not args.only or s[0] in args.only]
    record: dict[str, Any] = {"git_sha": args.git_sha, "device": jax.devices()[0].device_kind, "chained": CHAINED,
                              "metrics": {}}
    for shape in shapes:  # written after each shape: a call cut short keeps what it measured
        record["metrics"].update(probe_shape(shape, ways, args.smoke))
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
