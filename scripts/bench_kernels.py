"""Checks the Pallas kernels against their references at real shapes on the GPU, then times them side by side with
peers (JAX's bundled paged-attention op and Mosaic GPU attention, torch SDPA's flash and cuDNN backends, JAX's cuDNN
attention) and the measured ceilings (device-to-device copy, bf16 matmul). Writes one results JSON, prints a table.

Shapes: Llama-3-8B attention (32 query / 8 KV heads, d=128, bf16, pages of 16) — decode batch 64 × context 4096,
batch 8 × context 32k, a 4096-token causal prefill, and a mixed step of 60 decodes + one 2048-token chunk.

Ratios (names from the issue):
  decode_b64_ctx4k_bw_fraction   K+V bytes read / decode time, over the copy rate (read+write bytes / copy time);
                                 higher is better, target >= 0.93
  decode_b8_ctx32k_bw_fraction   the same at batch 8 × 32k
  decode_b64_ctx4k_vs_bundled    the bundled Pallas paged_attention time / our decode time; higher is better
  mixed_step_vs_sum              mixed-step time / (60 decodes alone + the chunk alone); lower is better, target <= 1.15
  fp8_vs_bf16_decode_speedup     bf16-cache decode time / float8-cache decode time, batch 64 × 4k, both with the
                                 shipped tuning, the float8 pool over 4 GiB; higher is better, target >= 1.7
                                 (also _b8_ctx32k)
  decode_b64_ctx4k_vs_cudnn_contiguous   torch SDPA cuDNN time on a contiguous bf16 cache / our (paged, bf16) decode
                                 time; higher is better, target >= 1.0 (also _vs_flash_, _b8_ctx32k_, _vs_jax_cudnn_)
  fp8_vs_bf16_mosaic_decode_b64_ctx4k_speedup  (`--only fp8`) the same speedup with both caches on the Mosaic GPU
                                 decode (fastest candidates), and fp8_mosaic_vs_fp8_/fp8_mosaic_vs_bf16_<shape> (the
                                 Triton float8 / bf16 decode's time ÷ the Mosaic float8 decode's)
  decode_b64_ctx4k_mosaic_vs_ours   (`--only peers`) our Triton decode's time / the Mosaic GPU decode's
                                 (`mosaic_decode.py`, TMA-loaded pages; its fastest candidate, checked against ours
                                 first), and _mosaic_vs_cudnn_contiguous (cuDNN's time / the Mosaic decode's); b8 × 32k
                                 likewise
  prefill_4k_vs_mgpu_f16         bundled Mosaic GPU attention (f16, contiguous) time / our paged bf16 prefill time,
                                 4096-token causal; higher is better
  prefill_4k_vs_matmul_rate      our causal prefill TFLOP/s / the measured bf16 matmul TFLOP/s (8192³)
  prefill_4k_mosaic_vs_triton    the Triton prefill's time / the Mosaic GPU prefill kernel's (`Tuning.mosaic_prefill`,
                                 checked against the reference first; metric mosaic_prefill_4k_causal_tflops)
Metric prefill_4k_causal_tflops: 2·S²·d·q_heads (causal half of 4·S²·d per head) / time; target >= 450.
  kv_write_t64_vs_scatter        XLA scatter time / jengine's K/V write (attention.pallas.write_kv) at 64 tokens,
                                 32 layers; higher is better, target >= 1.0 (also _t128 ... _t2048, and
                                 _pallas[_tpp2|_tpp1]_vs_scatter for the Pallas kernel alone, 8|2|1 tokens a program)

Timing: every function is compiled first and the GPU warmed (compile gaps inside timing once made decode read 1.6×
slow), then two interleaved passes, each `--runs` runs of n back-to-back calls (n sized to ~50 ms) with one
block_until_ready per run; the median. The cache (4.4 GB, pages shuffled) is far larger than L2, so decode reads come
from HBM. The decode and prefill block sizes are picked among a few candidates (each checked against the reference in
the same run) and the ratios are those of the pick, which `tuning.py` ships.
The cache holds random normals drawn in float32 and rounded to bf16 (drawn in bf16 directly, JAX gives only 128
distinct values, which makes fp8 rounding errors correlate and look about 3x worse than on continuous data).
Run on the H200: `PYTHONPATH=. python scripts/bench_kernels.py --out $OUT/kernels.json --git-sha <sha>`;
`--only GROUP,...` runs some of the groups (core, bundled, kv_write, backend, fp8, peers, prefill; each sized for a
call of a few minutes), and the figures of several calls merge into one file with `--merge A.json B.json --out FILE`
(no device needed). Peers that fail here are recorded under `errors` in the results. `--sweep`: the wide block-size
sweep and extra anchors; `--variants`: window/soft-cap/ragged/f32 checks; `--smoke`: tiny shapes in interpret mode,
to check the script on a CPU (the GPU-only peers then show up as errors).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import gpu_bench_common as common
import kernel_peers as peers
from gpu_bench_common import log
from pallas_kernels.addressing import offsets_overflow
from pallas_kernels.kv_quant import FP8_MAX, quantize
from pallas_kernels.kv_write import kernel as kv_write_kernel
from pallas_kernels.kv_write import reference as kv_write_reference
from pallas_kernels.ragged_paged_attention import kernel as rpa
from pallas_kernels.ragged_paged_attention import reference as rpa_reference
from pallas_kernels.ragged_paged_attention.tuning import (KernelConfig, MosaicConfig, MosaicDecodeConfig, SplitConfig,
                                                         Tuning, default_tuning)

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
LAYERS, LAYER = 4, 3  # > 4 GiB of cache: the kernels take their 64-bit-offset path, as in serving
NUM_PAGES = 16640
SCALE = HEAD_DIM ** -0.5
DTYPE = jnp.bfloat16
# Batch shapes (names from the issue); `--smoke` shrinks them to run the whole script on a CPU in interpret mode.
B_BIG, CTX, B_SMALL, CTX_LONG, PREFILL, MIX_DECODES, CHUNK = 64, 4096, 8, 32768, 4096, 60, 2048
COPY_ELEMENTS = 1 << 30
MATMUL_N = 8192
INTERPRET = False
MIN_CALLS = 5
GROUPS = ("core", "bundled", "kv_write", "backend", "fp8", "peers", "prefill")
DECODE_SHAPES = ("decode_b64_ctx4k", "decode_b8_ctx32k")


def apply_smoke() -> None:
    """Tiny shapes + interpret mode: checks the script itself (every section, the JSON) without a GPU."""
    global B_BIG, CTX, B_SMALL, CTX_LONG, PREFILL, MIX_DECODES, CHUNK, NUM_PAGES, COPY_ELEMENTS, INTERPRET, LAYERS
    global DECODE_SWEEP, PREFILL_SWEEP, MIN_CALLS, MATMUL_N, FP8_CANDIDATES
    B_BIG, CTX, B_SMALL, CTX_LONG, PREFILL, MIX_DECODES, CHUNK = 4, 256, 2, 512, 128, 3, 64
    NUM_PAGES, COPY_ELEMENTS, INTERPRET, LAYERS, MATMUL_N = 96, 1 << 20, True, LAYER + 1, 256
    FP8_CANDIDATES = [(32, 2, 3, 128, 4), (32, 2, 3, 128, 4, "float16")]
    DECODE_SWEEP, PREFILL_SWEEP, MIN_CALLS = DECODE_SWEEP[:1], PREFILL_SWEEP[:1], 1
    global DECODE_CANDIDATES, PREFILL_CANDIDATES
    DECODE_CANDIDATES = [(16, 2, 4, 64, 4), (32, 2, 3, 128, 4)]
    PREFILL_CANDIDATES = [(64, 32, 4, 2), ("mosaic", 64, 2), ("mosaic", 64, 2, False, True)]


def timeit(fn, *args, runs: int = 5) -> float:
    """Median seconds per call over `runs` runs of back-to-back calls (one sync per run)."""
    return common.timeit(fn, *args, runs=runs, min_calls=MIN_CALLS)


class Batch:
    """One ragged batch over the shared cache: queries, start offsets, lengths, shuffled block tables."""

    def __init__(self, rng: np.random.Generator, q_lens: list[int], seq_lens: list[int], width: int,
                 q: np.ndarray | None = None, tables: np.ndarray | None = None):
        self.q_lens, self.seq_lens = q_lens, seq_lens
        if tables is None:
            tables = np.zeros((len(q_lens), width), np.int32)
            pool = rng.permutation(NUM_PAGES)
            used = 0
            for i, s in enumerate(seq_lens):
                n = -(-s // BLOCK)
                tables[i, :n] = pool[used:used + n]
                used += n
            assert used <= NUM_PAGES
        self.tables_np = tables
        if q is None:
            q = rng.standard_normal((sum(q_lens), Q_HEADS, HEAD_DIM)).astype(np.float32)
        self.q_np = q
        self.q = jnp.asarray(q, DTYPE)
        self.qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        self.lens = jnp.asarray(seq_lens, jnp.int32)
        self.tables = jnp.asarray(tables)
        self.max_query_len = max(q_lens)

    @staticmethod
    def concat(a: "Batch", b: "Batch") -> "Batch":
        width = max(a.tables_np.shape[1], b.tables_np.shape[1])
        pad = lambda t: np.pad(t, ((0, 0), (0, width - t.shape[1])))  # noqa: E731
        return Batch(None, a.q_lens + b.q_lens, a.seq_lens + b.seq_lens, width,
                     q=np.concatenate([a.q_np, b.q_np]), tables=np.concatenate([pad(a.tables_np), pad(b.tables_np)]))

    def kv_bytes(self, itemsize: int = jnp.dtype(DTYPE).itemsize) -> int:
        return sum(self.seq_lens) * KV_HEADS * HEAD_DIM * 2 * itemsize

    def args(self, kv):
        return (self.q, kv, jnp.int32(LAYER), self.qsl, self.lens, self.tables)


_OURS: dict = {}


def ours(batch: Batch, tuning: Tuning | None = None, window: int = 0, soft_cap: float | None = None):
    """A jitted call of our kernel for this batch (default tuning unless given); one per (batch, settings), so
    sections that time the same thing share one compile. Arguments: `batch.args(kv)`, then the float8 cache's
    scales when `kv` is one."""
    key = (id(batch), tuning, window, soft_cap)
    if key not in _OURS:
        _OURS[key] = _build_ours(batch, tuning, window, soft_cap)
    return _OURS[key]


def _build_ours(batch: Batch, tuning: Tuning | None, window: int, soft_cap: float | None):
    fn = functools.partial(rpa.ragged_paged_attention_impl, scale=SCALE, soft_cap=soft_cap,
                           max_query_len=batch.max_query_len, interpret=INTERPRET, tuning=tuning)
    jitted = jax.jit(lambda q, kv, layer, qsl, lens, bt, w, scales: fn(q, kv, layer, qsl, lens, bt, sliding_window=w,
                                                                        kv_scales=scales))
    w = jnp.int32(window)
    return lambda *a: jitted(*a[:6], w, a[6] if len(a) > 6 else None)


def reference(batch: Batch, window: int = 0, soft_cap: float | None = None):
    return functools.partial(rpa_reference.ragged_paged_attention, scale=SCALE, sliding_window=window,
                             soft_cap=soft_cap, max_query_len=batch.max_query_len)


def prefill_flops() -> float:
    """Causal: half of 4·S²·d per query head (QKᵀ and PV, 2 flops per multiply-add)."""
    return 2 * PREFILL ** 2 * HEAD_DIM * Q_HEADS


def compare(out, ref) -> dict:
    """Max error relative to the output scale (DESIGN.md's parity rule: bf16 within 2e-2 of max|ref|)."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    err = float(np.max(np.abs(out - ref)))
    scale = float(np.max(np.abs(ref)))
    return {"max_abs_err": err, "max_abs_ref": scale, "rel_err": err / max(scale, 1e-30),
            "finite": bool(np.isfinite(out).all())}


class Bench:
    """Holds the results while the sections run; a failing section is logged and the others still run."""

    def __init__(self, args):
        self.args = args
        self.metrics: dict[str, float] = {}
        self.ratios: dict[str, float] = {}
        self.checks: dict[str, dict] = {}
        self.sweep: list[dict] = []
        self.errors: list[str] = []

    def section(self, name: str, fn) -> None:
        log(f"\n=== {name}")
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001 - one broken section must not cost the whole GPU call
            msg = traceback.format_exc()
            log(msg)
            self.errors.append(f"{name}: {msg.strip().splitlines()[-1]}")
        log(f"--- {name} took {time.perf_counter() - t0:.1f} s")

    def peer_error(self, name: str, error: Exception) -> None:
        """A peer that cannot run here is recorded (under `errors` in the results), never fatal."""
        first = (str(error).strip().splitlines() or [""])[0][:300]
        self.errors.append(f"{name}: {type(error).__name__}: {first}")
        log(f"  {name} failed: {type(error).__name__}: {first}")

    def metric(self, key: str, value: float) -> None:
        self.metrics[key] = value
        log(f"  {key:48s} {value:12.4f}")

    def check(self, key: str, out, ref, tol: float) -> None:
        c = compare(out, ref)
        c["ok"] = c["finite"] and c["rel_err"] <= tol
        self.checks[key] = c
        log(f"  check {key:42s} rel_err={c['rel_err']:.2e} max|ref|={c['max_abs_ref']:.3f} ok={c['ok']}")


def make_cache(key) -> jax.Array:
    shape = (LAYERS, NUM_PAGES, BLOCK, 2, KV_HEADS, HEAD_DIM)
    return jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(DTYPE))(key)  # see the docstring


def copy_bandwidth(bench: Bench) -> None:
    t, rate = common.copy_bandwidth(COPY_ELEMENTS, min_calls=MIN_CALLS)  # 2 GiB of bf16
    bench.metric("copy_us", t * 1e6)
    bench.metric("copy_tb_per_s", rate / 1e12)  # bytes read + written


def batches(rng) -> dict[str, Batch]:
    width = CTX // BLOCK
    decodes = Batch(rng, [1] * MIX_DECODES, [CTX] * MIX_DECODES, width)
    chunk = Batch(rng, [CHUNK], [2 * CHUNK], width)  # the second chunk of a prompt: over a cached prefix
    return {
        "decode_b64_ctx4k": Batch(rng, [1] * B_BIG, [CTX] * B_BIG, width),
        "decode_b8_ctx32k": Batch(rng, [1] * B_SMALL, [CTX_LONG] * B_SMALL, CTX_LONG // BLOCK),
        "prefill_4k": Batch(rng, [PREFILL], [PREFILL], PREFILL // BLOCK),
        "mixed_decodes": decodes,
        "mixed_chunk": chunk,
        "mixed": Batch.concat(decodes, chunk),
    }


def correctness_variants(bench: Bench, kv) -> None:
    """Windows, soft cap, ragged lengths, f32: smaller batches the dense reference can hold."""
    rng = np.random.default_rng(7)
    q_lens = [1, 1, 3, 17, 300, 1, 64, 1, 129, 2] if not INTERPRET else [1, 1, 3, 17, 30]
    seq_lens = [int(q + rng.integers(0, CTX - 1000 if not INTERPRET else 200)) for q in q_lens]
    b = Batch(rng, q_lens, seq_lens, CTX // BLOCK)
    for window, cap in ((0, None), (700, None), (0, 30.0), (128, 50.0)):
        bench.check(f"ragged_w{window}_cap{cap}", ours(b, window=window, soft_cap=cap)(*b.args(kv)),
                    reference(b, window=window, soft_cap=cap)(*b.args(kv)), 2e-2)
    small = SPLIT_SWEEP_SMALL
    bench.check("ragged_small_tiles", ours(b, tuning=small)(*b.args(kv)), reference(b)(*b.args(kv)), 2e-2)
    kv32 = kv[LAYER - 1:LAYER + 1].astype(jnp.float32)  # layer 1 of this copy is LAYER of the cache
    args32 = (b.q.astype(jnp.float32), kv32, jnp.int32(1), b.qsl, b.lens, b.tables)
    with jax.default_matmul_precision("highest"):
        bench.check("ragged_f32", ours(b, window=300)(*args32), reference(b, window=300)(*args32), 1e-4)


SPLIT_SWEEP_SMALL = Tuning(KernelConfig(16, 16, 4, 2), KernelConfig(64, 32, 4, 2), SplitConfig(64, 4))


def bundled_paged_attention(kv, b: Batch, ppcb: int = 4, k_splits: int = 32, num_warps: int = 4):
    """JAX's bundled Triton paged_attention (JAX-PALLAS.md §2.1) on our cache's pages in its layout."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
    k_pages = jnp.transpose(kv[LAYER, :, :, 0], (2, 0, 1, 3))  # [kv_heads, pages, page, d]
    v_pages = jnp.transpose(kv[LAYER, :, :, 1], (2, 0, 1, 3))
    if INTERPRET:
        ppcb, k_splits = 2, 4
    fn = jax.jit(lambda q, kp, vp, bt, lens: jax_pa.paged_attention(
        q * SCALE, kp, vp, bt, lens, pages_per_compute_block=ppcb, k_splits=k_splits, num_warps=num_warps,
        interpret=INTERPRET))
    return fn, (b.q, k_pages, v_pages, b.tables, b.lens)


def bundled(bench: Bench, kv, bs: dict[str, Batch]) -> None:
    """Bundled op vs ours, timed in interleaved passes (ours with the chosen tuning, else the shipped one)."""
    jobs = {}
    for name in ("decode_b64_ctx4k", "decode_b8_ctx32k"):
        fn, args = bundled_paged_attention(kv, bs[name])
        jobs[f"bundled_{name}"] = (fn, args)
        jobs[f"ours_{name}"] = (ours(bs[name], tuning=decode_tuning_of(bench)), bs[name].args(kv))
    t = time_jobs(jobs, runs=bench.args.runs)
    for name in ("decode_b64_ctx4k", "decode_b8_ctx32k"):
        bench.metric(f"bundled_{name}_us", t[f"bundled_{name}"] * 1e6)
        if f"ours_{name}" in t:
            bench.metric(f"ours_{name}_beside_bundled_us", t[f"ours_{name}"] * 1e6)
    if "ours_decode_b64_ctx4k" in t:
        bench.ratios["decode_b64_ctx4k_vs_bundled"] = t["bundled_decode_b64_ctx4k"] / t["ours_decode_b64_ctx4k"]


def xla_reference_decode(bench: Bench, kv, bs: dict[str, Batch]) -> None:
    b = bs["decode_b64_ctx4k"]
    bench.metric("xla_reference_decode_b64_ctx4k_us", timeit(reference(b), *b.args(kv), runs=bench.args.runs) * 1e6)


DECODE_SWEEP = [  # (block_n, num_warps, num_stages, split_tokens, max_splits)
    (64, 4, 3, 512, 16), (64, 4, 2, 512, 16), (64, 4, 4, 512, 16), (128, 4, 2, 512, 16), (128, 4, 3, 1024, 16),
    (32, 4, 4, 512, 16), (64, 2, 3, 512, 16), (128, 8, 3, 1024, 16), (64, 4, 3, 256, 32), (64, 4, 3, 1024, 8),
    (128, 4, 3, 2048, 16), (32, 2, 4, 256, 32),
]
PREFILL_SWEEP = [  # (block_m, block_n, num_warps, num_stages)
    (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 4), (64, 64, 4, 3), (64, 128, 4, 2),
    (128, 64, 8, 2), (256, 64, 8, 2), (128, 128, 8, 3), (64, 32, 4, 4),
]


# The final run picks the shipped defaults among these (each checked against the reference in the same run):
# decode (block_n, num_warps, num_stages, split_tokens, max_splits), prefill (block_m, block_n, num_warps, num_stages).
DECODE_CANDIDATES = [(64, 4, 2, 512, 16), (64, 2, 3, 256, 32), (64, 4, 3, 512, 16)]
# Triton (block_m, block_n, num_warps, num_stages), or ("mosaic", `MosaicConfig` fields...): the Mosaic GPU
# prefill for the long requests beside the default Triton prefill (Hopper only; elsewhere it fails its check)
PREFILL_CANDIDATES = [(128, 128, 8, 2), (128, 128, 8, 3), ("mosaic", 128, 3), ("mosaic", 128, 3, False, True)]


def decode_tuning(c) -> Tuning:
    """(block_n, num_warps, num_stages, split_tokens, max_splits[, a float8 cache's operand type]) → a Tuning."""
    base = default_tuning(HEAD_DIM, Q_HEADS // KV_HEADS)
    return Tuning(KernelConfig(base.decode.block_m, c[0], c[1], c[2]), base.prefill, SplitConfig(c[3], c[4]),
                  *c[5:])


def with_prefill(tuning: Tuning, c) -> Tuning:
    if c[0] == "mosaic":
        return Tuning(tuning.decode, tuning.prefill, tuning.split, mosaic_prefill=MosaicConfig(*c[1:]))
    return Tuning(tuning.decode, KernelConfig(*c), tuning.split)


def time_jobs(jobs: dict, passes: int = 2, runs: int = 5) -> dict[str, float]:
    """Every job compiled first, the GPU warmed, then `passes` interleaved passes: no compile gaps inside timing.
    A job is `(fn, args)` (JAX) or `(fn, args, timer)` (a peer with its own synchronisation: `kernel_peers`)."""
    for fn, args, *timer in jobs.values():
        (timer[0] if timer else timeit)(fn, *args, runs=1)
    warm = jax.jit(lambda a: a * 2)
    x = jnp.ones((1 << 28,), DTYPE)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < (0.5 if not INTERPRET else 0.0):
        x = warm(x)
    jax.block_until_ready(x)
    samples: dict[str, list[float]] = {k: [] for k in jobs}
    for _ in range(passes):
        for name, (fn, args, *timer) in jobs.items():
            samples[name].append((timer[0] if timer else timeit)(fn, *args, runs=runs))
    for name, ts in samples.items():
        log(f"  {name:60s} " + " ".join(f"{t * 1e6:9.1f}" for t in ts) + " us")
    return {k: statistics.median(v) for k, v in samples.items()}


def choose(bench: Bench, kv, bs: dict[str, Batch], refs: dict) -> Tuning:
    """Checks and times the decode and prefill candidates; returns the fastest correct pair (by summed time over
    the two decode shapes, resp. the prefill and the chunk)."""
    jobs, configs = {}, {}
    for c in DECODE_CANDIDATES:
        for name in ("decode_b64_ctx4k", "decode_b8_ctx32k"):
            key = f"decode{c}/{name}"
            jobs[key], configs[key] = (ours(bs[name], tuning=decode_tuning(c)), bs[name].args(kv)), ("d", c, name)
    for c in PREFILL_CANDIDATES:
        for name in ("prefill_4k", "mixed_chunk"):
            key = f"prefill{c}/{name}"
            tuning = with_prefill(decode_tuning(DECODE_CANDIDATES[0]), c)
            jobs[key], configs[key] = (ours(bs[name], tuning=tuning), bs[name].args(kv)), ("p", c, name)
    ok = {}
    for key, (fn, args) in jobs.items():
        kind, c, name = configs[key]
        c_ok = compare(fn(*args), refs[name])
        ok[(kind, c)] = ok.get((kind, c), True) and c_ok["finite"] and c_ok["rel_err"] <= 2e-2
        bench.checks[key] = {**c_ok, "ok": ok[(kind, c)]}
    times = time_jobs(jobs, runs=bench.args.runs)
    totals: dict = {}
    for key, t in times.items():
        kind, c, name = configs[key]
        totals[(kind, c)] = totals.get((kind, c), 0.0) + t
        bench.sweep.append({"candidate": key, "us": t * 1e6, "ok": ok[(kind, c)]})
    best = {kind: min((k for k in totals if k[0] == kind and ok[k]), key=totals.get) for kind in ("d", "p")}
    log(f"  chosen decode {best['d'][1]}, prefill {best['p'][1]}")
    bench.chosen = {"decode": best["d"][1], "prefill": best["p"][1]}
    bench.candidate_times = {configs[k][1:]: t for k, t in times.items()}
    return with_prefill(decode_tuning(best["d"][1]), best["p"][1])


def final_timings(bench: Bench, kv, bs: dict[str, Batch], tuning: Tuning, copy_rate: float | None) -> None:
    """The issue's numbers for the chosen tuning: decode and prefill from the candidate runs, the mixed step and its
    parts timed here (and checked: the mixed rows equal the parts' rows bit for bit)."""
    ct = bench.candidate_times
    t = {
        "decode_b64_ctx4k": ct[(bench.chosen["decode"], "decode_b64_ctx4k")],
        "decode_b8_ctx32k": ct[(bench.chosen["decode"], "decode_b8_ctx32k")],
        "prefill_4k": ct[(bench.chosen["prefill"], "prefill_4k")],
    }
    m, d, c = bs["mixed"], bs["mixed_decodes"], bs["mixed_chunk"]
    jobs = {n: (ours(bs[n], tuning=tuning), bs[n].args(kv)) for n in ("mixed_decodes", "mixed_chunk", "mixed")}
    parts = jnp.concatenate([jobs["mixed_decodes"][0](*d.args(kv)), jobs["mixed_chunk"][0](*c.args(kv))])
    diff = float(jnp.max(jnp.abs(jobs["mixed"][0](*m.args(kv)).astype(jnp.float32) - parts.astype(jnp.float32))))
    bench.checks["mixed_equals_parts"] = {"max_abs_diff": diff, "ok": diff == 0.0}
    log(f"  check mixed_equals_parts max_abs_diff={diff} ok={diff == 0.0}")
    t.update(time_jobs(jobs, runs=bench.args.runs))
    for name, value in t.items():
        bench.metric(f"{name}_us", value * 1e6)
    for name in ("decode_b64_ctx4k", "decode_b8_ctx32k"):
        rate = bs[name].kv_bytes() / t[name]
        bench.metric(f"{name}_tb_per_s", rate / 1e12)
        if copy_rate:
            bench.ratios[f"{name}_bw_fraction"] = rate / copy_rate
    bench.metric("prefill_4k_causal_tflops", prefill_flops() / t["prefill_4k"] / 1e12)
    bench.ratios["mixed_step_vs_sum"] = t["mixed"] / (t["mixed_decodes"] + t["mixed_chunk"])
    bench.t_ours = t


def references(bs: dict[str, Batch], kv) -> dict:
    out = {}
    for name in ("decode_b64_ctx4k", "decode_b8_ctx32k", "prefill_4k", "mixed_chunk"):
        b = bs[name]
        out[name] = jax.block_until_ready(reference(b)(*b.args(kv)))
    return out


def backend_check(bench: Bench, kv) -> None:
    """jengine's pallas_gpu backend (write + attention) against its reference backend on one mixed step."""
    from jengine.attention.backend import ReferenceBackend, select_backend
    from jengine.attention.metadata import AttentionMetadata

    backend = select_backend(jax.devices()[0].platform, head_dim=HEAD_DIM)
    if INTERPRET:
        from jengine.attention.pallas import PallasGpuBackend

        backend = PallasGpuBackend(interpret=True)
    rng = np.random.default_rng(11)
    n, ctx, chunk, chunk_len = (20, 1500, 600, 1000) if not INTERPRET else (3, 100, 40, 60)
    q_lens, seq_lens = [1] * n + [chunk], [int(x) for x in rng.integers(1, ctx, n)] + [chunk_len]
    b = Batch(rng, q_lens, seq_lens, -(-ctx // BLOCK))
    tables, slots, t = b.tables_np, np.zeros(sum(q_lens), np.int32), 0
    for i, (q, s) in enumerate(zip(q_lens, seq_lens)):
        for p in range(s - q, s):
            slots[t] = tables[i, p // BLOCK] * BLOCK + p % BLOCK
            t += 1
    md = AttentionMetadata(jnp.zeros(len(slots), jnp.int32), jnp.asarray(slots), b.qsl, b.lens, b.tables, chunk)
    k = jax.random.normal(jax.random.key(5), (len(slots), KV_HEADS, HEAD_DIM), DTYPE)
    kw = dict(scale=SCALE, sliding_window=jnp.int32(0), soft_cap=None)
    run = lambda be: jax.jit(lambda q, k, v, c, l, md: be(q, k, v, c, l, md, **kw))  # noqa: E731
    small = kv[:1]  # one layer: the two backends each get their own copy
    out, cache = run(backend)(b.q, k, k * 0.5, jnp.copy(small), jnp.int32(0), md)
    ref_out, ref_cache = run(ReferenceBackend())(b.q, k, k * 0.5, jnp.copy(small), jnp.int32(0), md)
    bench.check(f"backend_{backend.name}_vs_reference", out, ref_out, 2e-2)
    same = bool(jnp.array_equal(cache, ref_cache))
    bench.checks["backend_cache_equal"] = {"ok": same}
    log(f"  check backend_cache_equal {same}")


def sweep(bench: Bench, kv, bs: dict[str, Batch]) -> None:
    """Block-size sweep: each decode variant on both decode shapes, each prefill variant on the 4k prefill."""
    base = default_tuning(HEAD_DIM, Q_HEADS // KV_HEADS)
    for bn, warps, stages, split_tokens, max_splits in DECODE_SWEEP:
        tuning = Tuning(KernelConfig(base.decode.block_m, bn, warps, stages), base.prefill,
                        SplitConfig(split_tokens, max_splits))
        row = {"kernel": "decode", "block_n": bn, "num_warps": warps, "num_stages": stages,
               "split_tokens": split_tokens, "max_splits": max_splits}
        for name in ("decode_b64_ctx4k", "decode_b8_ctx32k"):
            try:
                b = bs[name]
                t = timeit(ours(b, tuning=tuning), *b.args(kv), runs=3)
                row[f"{name}_us"] = t * 1e6
                row[f"{name}_tb_per_s"] = b.kv_bytes() / t / 1e12
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = str(e).splitlines()[0][:300]
        bench.sweep.append(row)
        log("  ", row)
    for bm, bn, warps, stages in PREFILL_SWEEP:
        tuning = Tuning(base.decode, KernelConfig(bm, bn, warps, stages), base.split)
        row = {"kernel": "prefill", "block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages}
        try:
            b = bs["prefill_4k"]
            t = timeit(ours(b, tuning=tuning), *b.args(kv), runs=3)
            row["prefill_4k_us"] = t * 1e6
            row["prefill_4k_tflops"] = prefill_flops() / t / 1e12
            c = bs["mixed_chunk"]
            row["mixed_chunk_us"] = timeit(ours(c, tuning=tuning), *c.args(kv), runs=3) * 1e6
        except Exception as e:  # noqa: BLE001
            row["error"] = str(e).splitlines()[0][:300]
        bench.sweep.append(row)
        log("  ", row)


KV_WRITE_TOKENS = (64, 128, 256, 512, 1024, 2048)


def kv_write(bench: Bench, kv) -> None:
    """XLA scatter vs the Pallas write (8, 2 and 1 tokens a program) vs jengine's pick (`attention.pallas.write_kv`:
    the faster by token count), each inside one jit writing 32 layers' worth, unrolled and with the cache carried and
    donated, as in the step (a `fori_loop` adds a loop-condition round trip a layer that swamps a 64-token write),
    over decode- to prefill-sized batches: the crossover the pick uses. `kv_write_t64_vs_scatter` = scatter ÷ pick."""
    from jengine.attention.pallas import write_kv as jengine_write

    rng = np.random.default_rng(5)
    for tokens in KV_WRITE_TOKENS if not INTERPRET else (16,):
        slots = rng.choice(NUM_PAGES * BLOCK, tokens, replace=False).astype(np.int32)
        slots[-3:] = NUM_PAGES * BLOCK  # padding
        k = jax.random.normal(jax.random.key(tokens), (tokens, KV_HEADS, HEAD_DIM), DTYPE)
        v = k * 2
        variants = {"scatter": kv_write_reference.write_kv, "pallas": kv_write_kernel.write_kv,
                    "pallas_tpp2": functools.partial(kv_write_kernel.write_kv, tokens_per_program=2),
                    "pallas_tpp1": functools.partial(kv_write_kernel.write_kv, tokens_per_program=1),
                    "jengine": functools.partial(jengine_write, interpret=INTERPRET)}
        jobs, states = {}, {}
        for name, write in variants.items():
            if INTERPRET and name.startswith("pallas"):
                write = functools.partial(write, interpret=True)

            def layers32(cache, k, v, slots, write=write):
                for i in range(32):
                    cache = write(cache, i % LAYERS, slots, k, v)
                return cache

            fn = jax.jit(layers32, donate_argnums=(0,))
            state = {"cache": jnp.copy(kv)}

            def call(fn=fn, state=state):
                state["cache"] = fn(state["cache"], k, v, slots)
                return state["cache"]

            jobs[name], states[name] = (call, ()), state
        t = time_jobs(jobs, runs=bench.args.runs)
        for name in variants:
            bench.metric(f"kv_write_{name}_t{tokens}_x32_us", t[name] * 1e6)
        outs = {name: state["cache"] for name, state in states.items()}
        same = all(bool(jnp.array_equal(outs["scatter"], o)) for o in outs.values())
        bench.checks[f"kv_write_t{tokens}"] = {"ok": same}
        log(f"  check kv_write_t{tokens} equal={same}")
        bench.ratios[f"kv_write_t{tokens}_vs_scatter"] = t["scatter"] / t["jengine"]
        for name in variants:
            if name.startswith("pallas"):
                bench.ratios[f"kv_write_t{tokens}_{name}_vs_scatter"] = t["scatter"] / t[name]
        del outs, states, jobs

# ---------------------------------------------------------------------------------------------------------------
# float8 cache, peers, prefill anchors (groups fp8, peers, prefill)

# Decode tunings (block_n, num_warps, num_stages, split_tokens, max_splits) also timed on the float8 cache: half the
# bytes per position may want longer tiles. The ratio uses the shipped tuning; these go to the details file.
FP8_CANDIDATES = [(64, 4, 2, 512, 16), (64, 4, 3, 512, 16), (128, 4, 2, 512, 16), (64, 4, 3, 1024, 8)]
# `--sweep` adds these: float16 operands (`Tuning.fp8_operands`: one conversion a byte pair, shipped since 2d9a43c's
# sweep) on the shipped and nearby tiles, then wider and deeper bfloat16 tiles (49006d8 on an H100: none beat the
# then bfloat16-operand shipped one).
FP8_SWEEP = [(64, 4, 3, 1024, 8, "float16"), (64, 4, 4, 1024, 8, "float16"), (128, 4, 3, 1024, 8, "float16"),
             (64, 4, 2, 512, 16, "float16"), (128, 4, 3, 2048, 8), (64, 4, 4, 1024, 8), (128, 4, 3, 1024, 16)]
# e4m3's own rounding (3 mantissa bits, 2.6 % RMS per value) puts the decode output ~3.8 % (L2) from bf16's on
# standard-normal data (tests/kernels/test_fp8_kv.py); a broken scale or cast is far beyond this bound.
FP8_VS_BF16_L2_TOL = 5e-2


def decode_tuning_of(bench: Bench) -> Tuning | None:
    """The tuning the side-by-side ratios use: the candidate chosen in this call (group core), else the shipped one."""
    return decode_tuning(bench.chosen["decode"]) if hasattr(bench, "chosen") else None


@jax.jit
def fp8_cache(kv):
    """The cache as float8_e4m3fn with one scale per (layer, K/V, KV head), amax ÷ 448: the engine's calibration."""
    scales = jnp.max(jnp.abs(kv.astype(jnp.float32)), axis=(1, 2, 5)) / FP8_MAX
    return quantize(kv, (1.0 / scales)[:, None, None, :, :, None]), scales


def rel_l2(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def fp8_decode(bench: Bench, kv, bs: dict[str, Batch]) -> None:
    """float8 against bf16 pages at both decode shapes: checked against the reference on the dequantized cache and
    against the bf16 kernel, then timed side by side (shipped tuning, and the float8 candidates)."""
    kv8, scales = fp8_cache(kv)
    fp8_window_check(bench, kv8, scales, bs["decode_b64_ctx4k"])
    kv8, scales = large_fp8_cache(kv8, scales)
    bench.metric("fp8_pool_gib", kv8.nbytes / 2**30)
    tuning = None  # each cache with its shipped tuning (tuning.default_tuning)
    jobs = {}
    for name in DECODE_SHAPES:
        b = bs[name]
        fp8_args = (*b.args(kv8), scales)
        out8 = ours(b, tuning=tuning)(*fp8_args)
        ref8 = reference(b)(*b.args(kv8), kv_scales=scales)
        bench.check(f"fp8_{name}_vs_reference", out8, ref8, 2e-2)
        err = rel_l2(out8, ours(b, tuning=tuning)(*b.args(kv)))
        bench.metric(f"fp8_{name}_vs_bf16_rel_l2_err", err)
        bench.checks[f"fp8_{name}_vs_bf16"] = {"rel_l2_err": err, "ok": err <= FP8_VS_BF16_L2_TOL}
        jobs[f"bf16/{name}"] = (ours(b, tuning=tuning), b.args(kv))
        jobs[f"fp8/{name}"] = (ours(b, tuning=tuning), fp8_args)
        for c in FP8_CANDIDATES:
            c_ok = compare(ours(b, tuning=decode_tuning(c))(*fp8_args), ref8)
            bench.checks[f"fp8{c}/{name}"] = {**c_ok, "ok": c_ok["finite"] and c_ok["rel_err"] <= 2e-2}
            jobs[f"fp8{c}/{name}"] = (ours(b, tuning=decode_tuning(c)), fp8_args)
        # the Mosaic GPU decode on both caches, in the same passes
        jobs |= mosaic_decode_jobs(bench, b, kv8, ref8, name, kv_scales=scales, prefix="mosaic_fp8",
                                   against="reference")
        jobs |= mosaic_decode_jobs(bench, b, kv, ours(b, tuning=tuning)(*b.args(kv)), name, prefix="mosaic_bf16")
    t = time_jobs(jobs, runs=bench.args.runs)
    for name in DECODE_SHAPES:
        best8, best16 = fastest(bench, t, "mosaic_fp8", name), fastest(bench, t, "mosaic_bf16", name)
        if best8 is not None:
            bench.ratios[f"fp8_mosaic_vs_fp8_{name}"] = t[f"fp8/{name}"] / t[best8]  # Triton ÷ Mosaic, float8
            bench.ratios[f"fp8_mosaic_vs_bf16_{name}"] = t[f"bf16/{name}"] / t[best8]  # Triton bf16 ÷ Mosaic float8
            if best16 is not None:  # both caches on the Mosaic decode
                bench.ratios[f"fp8_vs_bf16_mosaic_{name}_speedup"] = t[best16] / t[best8]
    copy_rate = bench.metrics.get("copy_tb_per_s", 0) * 1e12
    for name in DECODE_SHAPES:
        bench.metric(f"fp8_{name}_us", t[f"fp8/{name}"] * 1e6)
        bench.metric(f"bf16_{name}_beside_fp8_us", t[f"bf16/{name}"] * 1e6)
        rate = bs[name].kv_bytes(itemsize=1) / t[f"fp8/{name}"]
        bench.metric(f"fp8_{name}_tb_per_s", rate / 1e12)
        if copy_rate:
            bench.ratios[f"fp8_{name}_bw_fraction"] = rate / copy_rate
        for c in FP8_CANDIDATES:
            bench.sweep.append({"candidate": f"fp8{c}/{name}", "us": t[f"fp8{c}/{name}"] * 1e6,
                                "ok": bench.checks[f"fp8{c}/{name}"]["ok"]})
    bench.ratios["fp8_vs_bf16_decode_speedup"] = t["bf16/decode_b64_ctx4k"] / t["fp8/decode_b64_ctx4k"]
    bench.ratios["fp8_vs_bf16_decode_b8_ctx32k_speedup"] = t["bf16/decode_b8_ctx32k"] / t["fp8/decode_b8_ctx32k"]
    best = min(FP8_CANDIDATES, key=lambda c: sum(t[f"fp8{c}/{n}"] for n in DECODE_SHAPES))
    log(f"  fastest float8 decode candidate {best}")
    for name in DECODE_SHAPES:
        bench.metric(f"fp8_best_candidate_{name}_us", t[f"fp8{best}/{name}"] * 1e6)


def large_fp8_cache(kv8, scales):
    """The float8 cache with its layers twice: over 4 GiB (the issue's pool size; the kernels' 64-bit offsets),
    the layer read keeping the same data and scales."""
    return jnp.concatenate([kv8, kv8], axis=0), jnp.concatenate([scales, scales], axis=0)


def fp8_window_check(bench: Bench, kv8, scales, b: Batch) -> None:
    """A float8 cache of (2, 4] GiB, the window where 1-byte elements overflow 32-bit offsets (addressing.py): the
    kernel reads it through its byte-pair view, checked against the reference on the same cache."""
    if not offsets_overflow(kv8.shape, kv8.dtype):
        log(f"  float8 cache of {kv8.nbytes / 2**30:.2f} GiB is outside the window: no window check")
        return
    out = ours(b)(*b.args(kv8), scales)
    ref = reference(b)(*b.args(kv8), kv_scales=scales)
    bench.check(f"fp8_window_{kv8.nbytes / 2**30:.2f}GiB_vs_reference", out, ref, 2e-2)


# (block_kv, slots, split, prefetch_pages) of the Mosaic GPU decode candidates timed beside the peers. A bf16 program
# holds its ring alone in shared memory (2 × slots × block_kv × 256 B): two 64 × 3 or three 64 × 2 rings share an SM;
# 64 × 4 and 128 × 2 rings take an SM each (at 13bb250, before the query and the output staging left shared memory,
# every candidate ran one program an SM and all timed within 3 % of each other)
MOSAIC_DECODE_CANDIDATES = ((64, 3, 2048, False), (64, 2, 2048, False), (64, 2, 1024, False), (64, 4, 2048, False),
                            (128, 2, 2048, False))
PEER_RATIOS = {"cudnn": "cudnn_contiguous", "flash": "flash_contiguous", "jax_cudnn": "jax_cudnn_contiguous"}


def peer_decode(bench: Bench, kv, bs: dict[str, Batch]) -> None:
    """torch SDPA (flash, cuDNN) and JAX's cuDNN attention on a contiguous bf16 copy of the same K/V, one query
    token per sequence, against our paged decode: each peer checked against our output, then timed beside it."""
    tuning = decode_tuning_of(bench)
    for name in DECODE_SHAPES:
        b = bs[name]
        k, v = peers.contiguous_kv(kv, jnp.int32(LAYER), b.tables, context=max(b.seq_lens))
        mine = ours(b, tuning=tuning)
        out = mine(*b.args(kv))
        builders = {
            "flash": lambda: peers.torch_sdpa_decode(b.q, k, v, "flash", SCALE),
            "cudnn": lambda: peers.torch_sdpa_decode(b.q, k, v, "cudnn", SCALE),
            "jax_cudnn": lambda: peers.jax_cudnn_decode(b.q, k, v, SCALE),
        }
        jobs = {f"ours/{name}": (mine, b.args(kv))} | mosaic_decode_jobs(bench, b, kv, out, name)
        for peer, build in builders.items():
            try:
                fn, args, timer = build()
                got = fn(*args)
                bench.check(f"{peer}_{name}_vs_ours", peers.torch_output(got) if timer is peers.timeit_torch else got,
                            out, 2e-2)
                timer(fn, *args, runs=1)  # its synchronisation works here too: timing it below cannot fail
                jobs[f"{peer}/{name}"] = (fn, args, timer)
            except Exception as e:  # noqa: BLE001 - a peer this machine cannot run is recorded, not fatal
                bench.peer_error(f"peer {peer} {name}", e)
        t = time_jobs(jobs, runs=bench.args.runs)
        bench.metric(f"ours_{name}_beside_peers_us", t[f"ours/{name}"] * 1e6)
        for peer, ratio in PEER_RATIOS.items():
            if f"{peer}/{name}" in t:
                bench.metric(f"{peer}_{name}_contiguous_us", t[f"{peer}/{name}"] * 1e6)
                bench.ratios[f"{name}_vs_{ratio}"] = t[f"{peer}/{name}"] / t[f"ours/{name}"]
        best = fastest(bench, t, "mosaic_decode", name)
        if best is not None:
            bench.ratios[f"{name}_mosaic_vs_ours"] = t[f"ours/{name}"] / t[best]
            if f"cudnn/{name}" in t:
                bench.ratios[f"{name}_mosaic_vs_cudnn_contiguous"] = t[f"cudnn/{name}"] / t[best]
        del k, v, jobs


def fastest(bench: Bench, t: dict[str, float], prefix: str, name: str) -> str | None:
    """The fastest of the timed jobs `<prefix>_*/<name>` (each recorded as a metric, the winner's name too)."""
    timed = {key: s for key, s in t.items() if key.startswith(prefix + "_") and key.endswith("/" + name)}
    for key, seconds in timed.items():
        bench.metric(f"{key.replace('/', '_')}_us", seconds * 1e6)
    if not timed:
        return None
    best = min(timed, key=timed.get)
    bench.metrics[f"{name}_{prefix}_best"] = best.split("/")[0]
    return best


def mosaic_decode_jobs(bench: Bench, b: Batch, kv, out, name: str, kv_scales=None, prefix: str = "mosaic_decode",
                       against: str = "ours") -> dict:
    """The Mosaic GPU decode's candidates on batch `b` (one query token a sequence; `kv_scales` with a float8
    cache), each checked against `out` (`against`: our Triton decode's output, or the reference's) first; those
    that fail to build or to match are recorded, not timed."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.ragged_paged_attention.mosaic_decode import mosaic_decode

    jobs = {}
    for block_kv, slots, split, prefetch in MOSAIC_DECODE_CANDIDATES:
        key = f"{prefix}_kv{block_kv}_s{slots}_split{split}{'_prefetch' if prefetch else ''}/{name}"
        interpret = plgpu.InterpretGPUParams() if INTERPRET else None
        config = MosaicDecodeConfig(block_kv, slots, split, prefetch)
        fn = jax.jit(functools.partial(mosaic_decode, scale=SCALE, config=config, kv_scales=kv_scales,
                                       interpret=interpret))
        args = (b.q, kv, jnp.int32(LAYER), b.lens, b.tables)
        try:
            check = key.replace("/", "_") + f"_vs_{against}"
            bench.check(check, fn(*args), out, 2e-2)
            if bench.checks[check]["ok"]:
                jobs[key] = (fn, args)
        except Exception as e:  # noqa: BLE001 - a candidate the compiler refuses is recorded, the rest still run
            bench.peer_error(key, e)
    return jobs


def prefill_anchors(bench: Bench, kv, bs: dict[str, Batch]) -> None:
    """The bf16 matmul rate, and the bundled Mosaic GPU attention (f16, contiguous) beside our 4k causal prefill."""
    rate = common.matmul_rate(MATMUL_N, runs=bench.args.runs, min_calls=MIN_CALLS)
    bench.metric("matmul_bf16_tflops", rate / 1e12)
    b = bs["prefill_4k"]
    tuning = None
    if hasattr(bench, "chosen"):
        tuning = with_prefill(decode_tuning(bench.chosen["decode"]), bench.chosen["prefill"])
    triton = dataclasses.replace(tuning or default_tuning(HEAD_DIM, Q_HEADS // KV_HEADS), mosaic_prefill=None)
    jobs = {"ours/prefill_4k": (ours(b, tuning=tuning), b.args(kv)),  # as shipped: Mosaic GPU on a Hopper GPU
            "ours_triton/prefill_4k": (ours(b, tuning=triton), b.args(kv))}
    shipped = default_tuning(HEAD_DIM, Q_HEADS // KV_HEADS, hopper=True).mosaic_prefill
    mosaic = ours(b, tuning=dataclasses.replace(triton, mosaic_prefill=shipped))
    try:
        bench.check("mosaic_prefill_4k_vs_reference", mosaic(*b.args(kv)), reference(b)(*b.args(kv)), 2e-2)
        jobs["ours_mosaic/prefill_4k"] = (mosaic, b.args(kv))
    except Exception as e:  # noqa: BLE001 - recorded; the Triton side still runs
        bench.peer_error("mosaic prefill", e)
    for name, causal in (("prefill_4k", True), ("prefill_4k_noncausal", False)):  # the second: its mask's cost
        try:
            job, mgpu_reference = peers.mgpu_prefill(PREFILL, Q_HEADS, KV_HEADS, HEAD_DIM, causal=causal)
            bench.check(f"mgpu_{name}_vs_xla_reference", job[0](*job[1]), mgpu_reference(), 2e-2)
            job[2](job[0], *job[1], runs=1)
            jobs[f"mgpu/{name}"] = job
        except Exception as e:  # noqa: BLE001 - a peer this machine cannot run is recorded, not fatal
            bench.peer_error(f"peer attention_mgpu {name}", e)
    t = time_jobs(jobs, runs=bench.args.runs)
    tflops = prefill_flops() / t["ours/prefill_4k"]
    bench.metric("prefill_4k_beside_mgpu_us", t["ours/prefill_4k"] * 1e6)
    bench.metric("prefill_4k_beside_mgpu_tflops", tflops / 1e12)
    bench.ratios["prefill_4k_vs_matmul_rate"] = tflops / rate
    if "ours_mosaic/prefill_4k" in t:  # the Mosaic GPU prefill kernel (`Tuning.mosaic_prefill`)
        bench.metric("mosaic_prefill_4k_causal_tflops", prefill_flops() / t["ours_mosaic/prefill_4k"] / 1e12)
        bench.ratios["prefill_4k_mosaic_vs_triton"] = t["ours_triton/prefill_4k"] / t["ours_mosaic/prefill_4k"]
    if "mgpu/prefill_4k" in t:
        bench.metric("mgpu_prefill_4k_causal_f16_tflops", prefill_flops() / t["mgpu/prefill_4k"] / 1e12)
        bench.ratios["prefill_4k_vs_mgpu_f16"] = t["mgpu/prefill_4k"] / t["ours/prefill_4k"]
    if "mgpu/prefill_4k_noncausal" in t:  # twice the causal FLOPs
        noncausal_flops = 2 * prefill_flops()
        bench.metric("mgpu_prefill_4k_noncausal_f16_tflops", noncausal_flops / t["mgpu/prefill_4k_noncausal"] / 1e12)


def merge_results(paths: list[str], out: str) -> None:
    """Several calls' results files (e.g. one per `--only` group) merged into one, as DESIGN.md asks."""
    merged = common.read_record(paths[0])
    for path in paths[1:]:
        merged = common.merge_records(merged, common.read_record(path))
    common.write_record(out, merged)
    common.print_tables(merged)


def write_results(bench: Bench) -> None:
    result = common.result_record("kernels", bench.args.git_sha, common.jax_device_name(), common.versions(["torch"]),
                                  " ".join(["python"] + sys.argv), bench.metrics, bench.ratios, errors=bench.errors)
    common.write_record(bench.args.out, result)
    details = {"chosen": getattr(bench, "chosen", None), "checks": bench.checks, "sweep": bench.sweep,
               "errors": bench.errors}
    with open(bench.args.details, "w") as f:
        json.dump(details, f, indent=2)
    common.print_tables(result)
    bad = [k for k, c in bench.checks.items() if not c.get("ok")]
    log(f"\nchecks failed: {bad or 'none'}; section errors: {len(bench.errors)}")
    for e in bench.errors:
        log("  ", e)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--details", default=None, help="checks and sweep JSON (default: beside --out)")
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sweep", action="store_true",
                        help="also the wide block-size sweep and extra anchors (group core), more float8 tiles (fp8)")
    parser.add_argument("--variants", action="store_true", help="also windows, soft cap, ragged and f32 checks")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU check of the script)")
    parser.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated groups of {', '.join(GROUPS)}")
    parser.add_argument("--merge", nargs="+", metavar="RESULTS", help="merge these results files into --out and exit")
    args = parser.parse_args()
    if args.merge:
        merge_results(args.merge, args.out)
        return
    groups = set(args.only.split(","))
    if groups - set(GROUPS):
        parser.error(f"unknown group(s) {', '.join(sorted(groups - set(GROUPS)))}; choose from {', '.join(GROUPS)}")
    if args.smoke:
        apply_smoke()
    if args.sweep and not args.smoke:
        FP8_CANDIDATES.extend(FP8_SWEEP)
    if args.details is None:
        args.details = args.out.rsplit("/", 1)[0] + "/attention_checks_and_sweep.json" if "/" in args.out \
            else "attention_checks_and_sweep.json"
    log("devices:", jax.devices(), "versions:", common.versions())
    bench = Bench(args)
    kv = make_cache(jax.random.key(0))
    bs = batches(np.random.default_rng(0))
    refs: dict = {}
    tuning: list[Tuning] = []
    if groups & {"core", "fp8"}:
        bench.section("copy bandwidth", lambda: copy_bandwidth(bench))
    if "core" in groups:
        bench.section("references", lambda: refs.update(references(bs, kv)))
        bench.section("candidates: check and time", lambda: tuning.append(choose(bench, kv, bs, refs)))
        copy_rate = bench.metrics.get("copy_tb_per_s", 0) * 1e12 or None
        if tuning:
            bench.section("final timings (chosen tuning)", lambda: final_timings(bench, kv, bs, tuning[0], copy_rate))
        write_results(bench)
    if "bundled" in groups:
        bench.section("bundled paged_attention", lambda: bundled(bench, kv, bs))
        write_results(bench)
    if "kv_write" in groups:
        bench.section("kv write: scatter vs pallas", lambda: kv_write(bench, kv))
    if "backend" in groups:
        bench.section("jengine pallas_gpu backend", lambda: backend_check(bench, kv))
    if "fp8" in groups:
        bench.section("float8 cache: decode beside bf16", lambda: fp8_decode(bench, kv, bs))
        write_results(bench)
    if "peers" in groups:
        bench.section("peers: torch SDPA flash/cuDNN, JAX cuDNN (decode)", lambda: peer_decode(bench, kv, bs))
        write_results(bench)
    if "prefill" in groups:
        bench.section("prefill: Mosaic GPU attention, bf16 matmul rate", lambda: prefill_anchors(bench, kv, bs))
    if args.variants:
        bench.section("correctness: window, soft cap, ragged, f32", lambda: correctness_variants(bench, kv))
    if args.sweep and "core" in groups:  # with group fp8 alone, --sweep widens its candidates only
        bench.section("XLA reference decode", lambda: xla_reference_decode(bench, kv, bs))
        bench.section("block-size sweep", lambda: sweep(bench, kv, bs))
    write_results(bench)

if __name__ == "__main__":
    main()
