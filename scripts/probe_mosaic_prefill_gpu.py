"""The Mosaic GPU prefill kernel (`pallas_kernels/ragged_paged_attention/mosaic_prefill.py`) beside the Triton
prefill kernel on the same paged batches: correctness first (sampled rows against a float32 reference), then
median times and TFLOP/s, each configuration its own entry; every shape in one run.

    PYTHONPATH=. python scripts/probe_mosaic_prefill_gpu.py --out OUT.json --git-sha SHA [--smoke]

Shapes (Llama-3.1-8B heads: 32 query / 8 KV heads, head_dim 128, bf16, 16-position pages): `prefill_4k` (one
4,096-token prompt; the kernel issue's `prefill_4k_causal_tflops` shape), `chunk_8k_ctx32k` (the last 8,192-token
chunk of a 32k prompt), `mixed` (requests of 3,000, 700, 100 and 65 new tokens over longer contexts, and padding).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from gpu_bench_common import log, timeit  # noqa: E402
from pallas_kernels.ragged_paged_attention import kernel as rpa  # noqa: E402
from pallas_kernels.ragged_paged_attention import mosaic_prefill as mp  # noqa: E402
from pallas_kernels.ragged_paged_attention.tuning import MosaicConfig, default_tuning  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
SCALE = HEAD_DIM ** -0.5
# name: ([(new tokens, context)], padding tokens, sliding window)
SHAPES = {
    "prefill_4k": ([(4096, 4096)], 0, 0),
    "chunk_8k_ctx32k": ([(8192, 32768)], 0, 0),
    "mixed": ([(3000, 3000), (700, 2900), (100, 5000), (65, 65), (1, 900)], 19, 0),
    "mixed_window1000": ([(3000, 3000), (700, 2900), (100, 5000), (65, 65), (1, 900)], 19, 1000),
}
SMOKE_SHAPES = {"mixed": ([(150, 250), (70, 70), (3, 8)], 5, 0), "window": ([(200, 330), (64, 64)], 3, 90)}
CONFIGS = {"kv128_s2": MosaicConfig(128, 2), "kv128_s3": MosaicConfig(128, 3),
           "kv128_s3_persistent": MosaicConfig(128, 3, persistent=True), "kv64_s2": MosaicConfig(64, 2),
           "kv64_s3": MosaicConfig(64, 3),
           "kv128_s2_staged": MosaicConfig(128, 2, staged_pv=True)}


def batch(requests, padding, rng, heads=(Q_HEADS, KV_HEADS, HEAD_DIM), block=BLOCK):
    q_heads, kv_heads, dim = heads
    q_lens = [n for n, _ in requests]
    lens = [c for _, c in requests]
    pages = [-(-c // block) for c in lens]
    width = max(pages)
    blocks = sum(pages) + 8
    order = rng.permutation(blocks)
    bt = np.zeros((len(requests), width), np.int32)
    used = 0
    for i, n in enumerate(pages):
        bt[i, :n] = order[used:used + n]
        used += n
    tokens = sum(q_lens) + padding
    q = jnp.asarray(rng.standard_normal((tokens, q_heads, dim), np.float32), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((2, blocks, block, 2, kv_heads, dim), np.float32), jnp.bfloat16)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (q, kv, jnp.int32(1), jnp.asarray(qsl), jnp.asarray(lens, jnp.int32), jnp.asarray(bt)), q_lens, lens


def sampled_reference(args, q_lens, lens, window, rng, per_request=96):
    """float32 attention of sampled rows of every request: {token: [q_heads, dim]}."""
    q, kv, layer, qsl, _, bt = args
    out = {}
    for r, (n, ctx) in enumerate(zip(q_lens, lens)):
        pages = kv[1][bt[r]].reshape(-1, 2, KV_HEADS, HEAD_DIM)[:ctx].astype(jnp.float32)
        k, v = jnp.repeat(pages[:, 0], Q_HEADS // KV_HEADS, 1), jnp.repeat(pages[:, 1], Q_HEADS // KV_HEADS, 1)
        rows = np.unique(np.concatenate([[0, n - 1], rng.integers(0, n, per_request)]))
        tokens = int(qsl[r]) + rows
        behind = jnp.asarray(ctx - n + rows)[:, None] - jnp.arange(ctx)[None, :]
        visible = (behind >= 0) & ((window <= 0) | (behind < window))
        s = jnp.einsum("rhd,khd->rhk", q[tokens].astype(jnp.float32), k, precision="highest") * SCALE
        s = jnp.where(visible[:, None, :], s, -jnp.inf)
        o = jnp.einsum("rhk,khd->rhd", jax.nn.softmax(s, -1), v, precision="highest")
        out.update({int(t): o[i] for i, t in enumerate(tokens)})
    return out


def check(out, ref, rows) -> dict:
    """Sampled rows (of `rows`) against the reference, every one of `rows` finite."""
    out = np.asarray(out.astype(jnp.float32))
    ref = {t: r for t, r in ref.items() if t in set(rows.tolist())}
    err = max(float(np.max(np.abs(out[t] - np.asarray(r)))) for t, r in ref.items())
    scale = max(float(np.max(np.abs(np.asarray(r)))) for r in ref.values())
    finite = bool(np.isfinite(out[rows]).all())
    return {"rows": len(ref), "max_abs_err": err, "rel_err": err / scale, "finite": finite,
            "ok": finite and err / scale <= 2e-2}


def flops(q_lens, lens, window) -> float:
    """QKᵀ and PV over each new token's visible positions, 2 flops a multiply-add, all query heads."""
    seen = (lambda pos: min(pos + 1, window)) if window > 0 else (lambda pos: pos + 1)
    return sum(4.0 * HEAD_DIM * Q_HEADS * sum(seen(c - n + i) for i in range(n)) for n, c in zip(q_lens, lens))


def run(shapes, configs, interpret, save) -> dict:
    """Every shape's entry; `save(results)` after each, so a cut-short run keeps what it measured."""
    rng = np.random.default_rng(0)
    results = {}
    for name, (requests, padding, window) in shapes.items():
        args, q_lens, lens = batch(requests, padding, rng)
        ref = sampled_reference(args, q_lens, lens, window, rng)
        long = [(n, c) for n, c in zip(q_lens, lens) if n >= mp.ROWS_PER_GROUP]
        f = flops([n for n, _ in long], [c for _, c in long], window)
        entry = {"requests": requests, "window": window, "flops_long_requests": f}
        qsl = np.asarray(args[3])
        long_rows = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i, n in enumerate(q_lens)
                                    if n >= mp.ROWS_PER_GROUP])
        triton_only = default_tuning(HEAD_DIM, Q_HEADS // KV_HEADS, hopper=False)
        jobs = {"triton": jax.jit(functools.partial(rpa.ragged_paged_attention_impl, scale=SCALE, sliding_window=window,
                                                    soft_cap=None, max_query_len=max(q_lens), interpret=interpret,
                                                    tuning=triton_only))}
        for cname, cfg in configs.items():
            jobs[f"mosaic_{cname}"] = jax.jit(functools.partial(
                mp.mosaic_prefill, scale=SCALE, sliding_window=window, config=cfg,
                interpret=plgpu.InterpretGPUParams() if interpret else None))
        wired = default_tuning(HEAD_DIM, Q_HEADS // KV_HEADS, hopper=True)  # as shipped on Hopper
        jobs["wired"] = jax.jit(functools.partial(rpa.ragged_paged_attention_impl, scale=SCALE, sliding_window=window,
                                                  soft_cap=None, max_query_len=max(q_lens), interpret=interpret,
                                                  tuning=wired))
        all_rows = np.arange(int(qsl[-1]) + padding)
        for jname, fn in jobs.items():
            try:
                c = check(fn(*args), ref, long_rows if jname.startswith("mosaic") else all_rows)
                item = {"check": c}
                if not interpret and c["ok"]:
                    t = timeit(fn, *args, runs=5)
                    item.update(us=t * 1e6, tflops=f / t / 1e12)
            except Exception as e:  # noqa: BLE001 - one failing configuration must not cost the others
                item = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            entry[jname] = item
            log(name, jname, json.dumps(item))
        results[name] = entry
        save(results)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--smoke", action="store_true", help="interpret mode on the CPU, two small shapes")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    shapes = SMOKE_SHAPES if args.smoke else {k: SHAPES[k] for k in args.shapes}

    def save(results):
        record = {"benchmark": "mosaic_prefill", "git_sha": args.git_sha, "device": jax.devices()[0].device_kind,
                  "command": " ".join(sys.argv), "results": results}
        Path(args.out).write_text(json.dumps(record, indent=1))

    run(shapes, {k: CONFIGS[k] for k in args.configs}, interpret=args.smoke, save=save)
    log("written:", args.out)


if __name__ == "__main__":
    main()
