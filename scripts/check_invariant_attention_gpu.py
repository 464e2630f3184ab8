"""GPU check of the batch-invariant attention (`single_path`, the deterministic engine's): bitwise, then its cost.

Bits, on Llama-3.1-8B's attention shapes (32 query / 8 KV heads, d=128, bf16, pages of 16): a request's last 1 and 3
rows computed inside a 40-token chunk (the prefill kernel) against the same rows as their own decode or short chunk
(the decode kernel), and against the chunk in the 128-row tiles of a large bucket, over contexts of 180 and 1,000
positions (KV tiles crossed), with and without a sliding window; and one request's decode row alone against the same
row at the top of a 64-request decode step and of a mixed step (beside a 200-token prefill).

Time, a decode-only step (one token per request) at batch 64 × 4k, 256 × 576 and 8 × 32k, three ways: the invariant
path, the path it replaced (every request through the prefill kernel), and the default split-K decode path; each
with the step's KV bytes ÷ the copy bandwidth measured in the same process. Then short chunks over long contexts
(64 new tokens over 2,112, as a prefix-cache hit; 8 × 32 over 4k; 128 over 8k) in the invariant mode's small tiles
of their bucket against its 128-row tiles, and the default mode's beside. `--decode-variants`: the invariant
decode-only steps with other warps and stages for its tile, batch 1 at 576 positions too (bits checked against the
shipped one; each timed as 16 dependent calls inside one program, so a batch-1 call's few µs are not the host's). `--segment S`:
every bit check again with long contexts in S-position segments (`Tuning.invariant_segment`; `--split C`: C positions
a decode program, `Tuning.invariant_split`), its decode times and the short chunks in those segments.

    PYTHONPATH=. python scripts/check_invariant_attention_gpu.py --out $OUT/invariant-attention.json --git-sha <sha>
    PYTHONPATH=. python scripts/check_invariant_attention_gpu.py --smoke --out /tmp/inv.json   # CPU: paths only
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench_common import copy_bandwidth, log, timeit  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
TIMED = ((64, 4096), (256, 576), (8, 32768), (1, 32768))


@dataclasses.dataclass(frozen=True)
class Step:
    q: Any
    kv: Any
    qsl: Any
    lens: Any
    tables: Any
    max_query_len: int


def make_step(q_lens: list[int], contexts: list[int], *, seed: int, num_tokens: int | None = None,
              width: int | None = None) -> Step:
    """Random queries and cache; each request's pages drawn at random from the pool (page 0 unused)."""
    import jax
    import jax.numpy as jnp

    pages = [-(-c // BLOCK) for c in contexts]
    width = width or max(pages)
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.arange(1, sum(pages) + 1))
    tables = np.zeros((len(contexts), width), np.int32)
    used = 0
    for i, n in enumerate(pages):
        tables[i, :n] = order[used:used + n]
        used += n
    keys = jax.random.split(jax.random.key(seed))
    tokens = num_tokens or sum(q_lens)
    kv = jax.random.normal(keys[0], (1, sum(pages) + 1, BLOCK, 2, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    q = jax.random.normal(keys[1], (tokens, Q_HEADS, HEAD_DIM), jnp.bfloat16)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return Step(q, kv, jnp.asarray(qsl), jnp.asarray(contexts, jnp.int32), jnp.asarray(tables), max(q_lens))


def _attention(step: Step, *, single_path: bool, window: int = 0, interpret: bool = False,
               segment: int | None = None, split: int | None = None, apart: bool | None = None):
    """One attention call; in segments (`segment`, `split`), a short step's segments on programs of their own
    unless `apart` is False."""
    from pallas_kernels.ragged_paged_attention import kernel

    return kernel.ragged_paged_attention(step.q, step.kv, 0, step.qsl, step.lens, step.tables,
                                         scale=HEAD_DIM ** -0.5, sliding_window=np.int32(window),
                                         max_query_len=step.max_query_len, interpret=interpret,
                                         single_path=single_path, invariant_segment=segment,
                                         invariant_split=split,
                                         parallel_short_segments=bool(segment) if apart is None else apart)


@functools.cache
def prefill_only(interpret: bool):
    """The invariant path before: every request through the prefill kernel (no request fits a 2-row decode tile)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import kernel
    from pallas_kernels.ragged_paged_attention.tiles import Geometry, Scores
    from pallas_kernels.ragged_paged_attention.tuning import default_tuning

    base = default_tuning(HEAD_DIM, Q_HEADS // KV_HEADS)
    tuning = dataclasses.replace(base, decode=dataclasses.replace(base.decode, block_m=2))

    @jax.jit
    def run(q, kv, qsl, lens, tables):
        geo = Geometry(q.shape[0], lens.shape[0], Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, False)
        return kernel._prefill_call(q, kv, jnp.ones((1,), jnp.float32), kernel._scalars(0, 0), qsl, lens, tables,
                                    geo, tuning, Scores(HEAD_DIM ** -0.5, None, None), interpret)

    return run


def bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint16)


def chunk_checks(interpret: bool, segment: int | None = None, split: int | None = None) -> dict[str, bool]:
    """The last `count` rows of a 40-token chunk against the same rows as their own (decode-kernel) chunk."""
    import jax.numpy as jnp

    attention = functools.partial(_attention, segment=segment, split=split)
    out = {}
    for context in (180, 1000, *((5000,) if segment else ())):  # segments: a context crossing two boundaries
        whole = make_step([40], [context], seed=context)
        for window in (0, 50):
            rows = bits(attention(whole, single_path=True, window=window, interpret=interpret))
            for count in (1, 3):
                q = jnp.zeros_like(whole.q).at[:count].set(whole.q[40 - count:40])
                part = dataclasses.replace(whole, q=q, qsl=jnp.asarray([0, count], jnp.int32), max_query_len=count)
                got = bits(attention(part, single_path=True, window=window, interpret=interpret))
                out[f"ctx{context}_window{window}_last{count}"] = bool((got[:count] == rows[40 - count:40]).all())
            wide = dataclasses.replace(whole, max_query_len=1024)  # a large bucket: the 128-row prefill tiles
            out[f"ctx{context}_window{window}_small_vs_wide_tiles"] = bool(
                (bits(attention(wide, single_path=True, window=window, interpret=interpret))[:40]
                 == rows[:40]).all())
    return out


def batch_checks(interpret: bool, batch: int = 64, segment: int | None = None,
                 split: int | None = None) -> dict[str, bool]:
    """One request's decode row alone, at the top of a decode-only batch, and beside a prefill."""
    import jax.numpy as jnp

    attention = functools.partial(_attention, segment=segment, split=split)
    contexts = [3000 if segment else 700] + [300 + 37 * i for i in range(batch - 1)]  # segments: the row crosses one
    full = make_step([1] * batch, contexts, seed=3)
    alone = dataclasses.replace(full, q=full.q[:1], qsl=full.qsl[:2], lens=full.lens[:1], tables=full.tables[:1])
    mixed_q = jnp.concatenate([full.q[:1], make_step([200], [400], seed=4).q]).astype(full.q.dtype)
    mixed = dataclasses.replace(full, q=mixed_q, qsl=jnp.asarray([0, 1, 201], jnp.int32),
                                lens=jnp.asarray([contexts[0], 400], jnp.int32),
                                tables=full.tables[:2].at[1].set(full.tables[1]), max_query_len=200)
    row = bits(attention(alone, single_path=True, interpret=interpret))[:1]
    return {"top_of_decode_batch": bool((bits(attention(full, single_path=True, interpret=interpret))[:1]
                                         == row).all()),
            "beside_a_prefill": bool((bits(attention(mixed, single_path=True, interpret=interpret))[:1]
                                      == row).all())}


def decode_kv_bytes(batch: int, context: int) -> int:
    """The K and V bytes (bf16) a decode-only step of `batch` requests over `context` positions reads."""
    return batch * context * KV_HEADS * HEAD_DIM * 2 * 2


def timings(bandwidth: float, segment: int | None = None, split: int | None = None) -> dict[str, float]:
    out: dict[str, float] = {}
    for batch, context in TIMED:
        step = make_step([1] * batch, [context] * batch, seed=batch)
        kv_bytes = decode_kv_bytes(batch, context)
        ways = {"invariant": lambda s=step: _attention(s, single_path=True),
                "prefill_only": lambda s=step: prefill_only(False)(s.q, s.kv, s.qsl, s.lens, s.tables),
                "default": lambda s=step: _attention(s, single_path=False)}
        if segment:
            ways["invariant_segmented"] = lambda s=step: _attention(s, single_path=True, segment=segment, split=split)
        for name, fn in ways.items():
            seconds = timeit(fn)
            out[f"{name}_b{batch}_ctx{context}_us"] = seconds * 1e6
            out[f"{name}_b{batch}_ctx{context}_bw_fraction"] = kv_bytes / seconds / bandwidth
        log(batch, context, {k: round(v, 3) for k, v in out.items() if f"_b{batch}_" in k})
    return out


DECODE_VARIANTS = ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3))  # (warps, stages) of the invariant decode tile (shipped)
# The variants' shapes: TIMED's and batch 1 at a short context, where a decode step's 8 programs (one a KV head) wait
# on their loads (8.2 µs a layer for 2.4 MB in the engine's batch-1 profile, b9302db)
VARIANT_SHAPES = (*TIMED, (1, 576))
CHAINED_CALLS = 16  # attention calls a timed program makes, each on the last one's output (as a step's layers do)


def tuned_call(step: Step, tuning, *, single_path: bool, interpret: bool = False):
    """The attention of `step` with `tuning` as a function of its queries."""
    from pallas_kernels.ragged_paged_attention import kernel

    def call(q):
        return kernel.ragged_paged_attention_impl(
            q, step.kv, 0, step.qsl, step.lens, step.tables, scale=HEAD_DIM ** -0.5, sliding_window=np.int32(0),
            soft_cap=None, max_query_len=step.max_query_len, interpret=interpret, tuning=tuning,
            single_path=single_path)

    return call


def chained_seconds(call, q, calls: int) -> float:
    """Seconds a call of `call`, timed as `calls` dependent calls inside one program (each on the last one's
    output, as a step's layers run): no host dispatch between them."""
    import jax

    @jax.jit
    def chained(q):
        for _ in range(calls):
            q = call(q).astype(q.dtype)
        return q

    return timeit(chained, q) / calls


def decode_variant_timings(bandwidth: float) -> dict[str, float]:
    """The invariant decode-only steps with other warps and stages for the decode kernel's 128-position tiles (its
    additions do not depend on either: checked here bit for bit against the shipped tile), µs a call and ÷ copy,
    timed as CHAINED_CALLS dependent calls inside one program (no host dispatch between them)."""
    from pallas_kernels.ragged_paged_attention.tuning import default_tuning

    base = default_tuning(HEAD_DIM, Q_HEADS // KV_HEADS)
    out: dict[str, float] = {}
    for batch, context in VARIANT_SHAPES:
        step = make_step([1] * batch, [context] * batch, seed=batch)
        kv_bytes = decode_kv_bytes(batch, context)
        shipped = bits(_attention(step, single_path=True))
        for warps, stages in DECODE_VARIANTS:
            tuning = dataclasses.replace(base, decode=dataclasses.replace(base.decode, num_warps=warps,
                                                                          num_stages=stages))
            call = tuned_call(step, tuning, single_path=True)
            key = f"invariant_w{warps}_s{stages}_b{batch}_ctx{context}"
            out[f"{key}_same_bits"] = float(np.array_equal(bits(call(step.q)), shipped))
            seconds = chained_seconds(call, step.q, CHAINED_CALLS)
            out[f"{key}_us"] = seconds * 1e6
            out[f"{key}_bw_fraction"] = kv_bytes / seconds / bandwidth
        log(batch, context, {k: round(v, 3) for k, v in out.items() if f"_b{batch}_" in k})
    return out


SHORT_CHUNKS = ((1, 64, 2112), (8, 32, 4096), (1, 128, 8192))  # (requests, new tokens each, context)


def short_chunk_timings(segment: int | None = None, split: int | None = None) -> dict[str, float]:
    """Short chunks over long contexts (a prefix-cache hit's suffix), batch-invariant mode: the step's tiles for its
    bucket (small) against the 128-row prefill tiles a large bucket takes; the default mode's (128-row) beside; with
    `segment`, the small tiles in those segments too, each segment a program (`Tuning.segments_apart`) and walked."""
    out: dict[str, float] = {}
    for requests, tokens, context in SHORT_CHUNKS:
        step = make_step([tokens] * requests, [context] * requests, seed=tokens)
        wide = dataclasses.replace(step, max_query_len=1024)
        ways = {"invariant_small": (step, True, {}), "invariant_wide": (wide, True, {}), "default": (step, False, {})}
        if segment:
            segmented = dict(segment=segment, split=split)
            ways["invariant_segmented_small"] = (step, True, {**segmented, "apart": True})
            ways["invariant_segmented_walk_small"] = (step, True, {**segmented, "apart": False})
        for name, (s, invariant, how) in ways.items():
            seconds = timeit(lambda s=s, inv=invariant, how=how: _attention(s, single_path=inv, **how))
            out[f"{name}_tiles_r{requests}_q{tokens}_ctx{context}_us"] = seconds * 1e6
        log(requests, tokens, context, {k: round(v, 1) for k, v in out.items() if f"_q{tokens}_" in k})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--smoke", action="store_true", help="interpret mode on the CPU, no timings")
    parser.add_argument("--segment", type=int, default=None,
                        help="also the bits and decode times with Tuning.invariant_segment (e.g. 256)")
    parser.add_argument("--split", type=int, default=None,
                        help="with --segment: the positions one decode program walks (Tuning.invariant_split)")
    parser.add_argument("--decode-variants", action="store_true",
                        help="also the invariant decode tile with other warps and stages (DECODE_VARIANTS)")
    args = parser.parse_args()
    import jax

    record: dict[str, Any] = {"git_sha": args.git_sha, "device": jax.devices()[0].device_kind}
    record["bitwise"] = {**chunk_checks(args.smoke), **batch_checks(args.smoke, 4 if args.smoke else 64)}
    if args.segment:
        record["bitwise_segmented"] = {**chunk_checks(args.smoke, args.segment, args.split),
                                       **batch_checks(args.smoke, 4 if args.smoke else 64, args.segment, args.split)}
    log(record["bitwise"], record.get("bitwise_segmented"))
    if not args.smoke:
        _, bandwidth = copy_bandwidth()
        record["copy_tb_per_s"] = bandwidth / 1e12
        record["metrics"] = {**timings(bandwidth, args.segment, args.split),
                             **short_chunk_timings(args.segment, args.split)}
        if args.decode_variants:
            record["metrics"].update(decode_variant_timings(bandwidth))
    Path(args.out).write_text(json.dumps(record, indent=1))
    log(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
