"""The MoE grouped matmul on the GPU: correctness first, then one layer's experts timed beside XLA's `ragged_dot`,
a loop over experts, tokamax's Mosaic GPU `ragged_dot`, jax's own (`ragged_dot_mgpu`, from 256 tokens; ratio
`moe_kernel_vs_jax_mgpu_t<N>`, its time ÷ ours) and the bytes / FLOP ceilings measured in the same call.

    PYTHONPATH=. python scripts/bench_moe_kernels.py --out DIR --git-sha SHA [--sweep] [--narrow int4 fp8_block]

Shapes: one Qwen3-30B-A3B layer (hidden 2048, 128 experts, top-8, expert width 768) at 1, 16, 64, 256 and 4096
tokens, random bf16 weights and uniform random routing. The decode floor of a layer's experts is the bytes of the
distinct experts routed to (counted from the routing) plus the activations, ÷ the copy bandwidth. Writes
`DIR/<date>-moe.json` (merged with the whole-model figures of `scripts/bench_moe.py`).

`--narrow KIND ...` (with `--sweep`: each format's own tile sweep first) times the same layer with quantized
experts beside the bf16 ones, after checking each against the
float32 reference of its dequantized weights: `int4` (random words, float16 group-128 scales and zero points, as an
AWQ/GPTQ Qwen3-30B-A3B stores them) and `fp8_block` (float8 weights, one float32 scale per 128 × 128 block, as
Qwen3-30B-A3B-FP8). Ratios `moe_<KIND>_layer_t<N>_vs_floor` (the routed experts' bytes in that format, scales and
zero points included) and `moe_<KIND>_layer_t<N>_vs_bf16` (bf16 time ÷ its time).

`--mosaic [CANDIDATE ...]` times the Mosaic GPU grouped matmuls (`pallas_kernels/grouped_matmul/mosaic.py`: the rows
gathered into expert order, TMA and wgmma tiles) beside the Triton kernels at `--tokens` (default 256, 1024, 4096),
each checked first (against float32 up to 256 tokens, against the Triton kernels' output above); a candidate
`R,NU,ND,K,C[,ws]` is R-row tiles, gate/up NU and down ND columns wide, K-input steps, C steps in flight (`ws`:
warp-specialised, `MosaicTiles.warp_specialized`). Ratios
`moe_layer_t<N>_mosaic_vs_triton` (Triton time ÷ the best candidate's) and, at 4096 tokens,
`moe_prefill_mosaic_vs_matmul_rate` (the best candidate's FLOP rate ÷ the dense bf16 matmul rate of the same call).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import save  # noqa: E402
from gpu_bench_common import copy_bandwidth, log, matmul_rate, timeit  # noqa: E402

from jengine.layers.mlp import skip_padding  # noqa: E402
from pallas_kernels.grouped_matmul import ExpertWeights, TileConfig, moe_experts, mosaic, tile_configs  # noqa: E402
from pallas_kernels.grouped_matmul.kernel import expert_down, expert_gate_up, scaling_of  # noqa: E402
from pallas_kernels.grouped_matmul.moe import WORKERS_PER_SM, fit_steps, layout_for  # noqa: E402
from pallas_kernels.grouped_matmul.routing import COMPARE_MAX_PAIRS, expert_tiles  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
TOKENS = (1, 16, 64, 256, 4096)


def weights(key, dtype=jnp.bfloat16, e=EXPERTS, d=HIDDEN, i=INTER) -> ExpertWeights:
    kg, ku, kd = jax.random.split(key, 3)
    s = d ** -0.5
    return ExpertWeights(jax.random.normal(kg, (e, d, i), dtype) * s, jax.random.normal(ku, (e, d, i), dtype) * s,
                         jax.random.normal(kd, (e, i, d), dtype) * i ** -0.5)


def routing(key, tokens: int, e=EXPERTS, k=TOP_K):
    logits = jax.random.normal(key, (tokens, e), jnp.float32)
    w, ex = jax.lax.top_k(jax.nn.softmax(logits), k)
    return ex.astype(jnp.int32), (w / w.sum(-1, keepdims=True)).astype(jnp.bfloat16)


def reference(x, w: ExpertWeights, ex, rw):
    """float32 per (token, choice): gather the expert's weights and multiply; exact enough at these sizes."""
    with jax.default_matmul_precision("highest"):
        f = lambda a: a.astype(jnp.float32)
        g = jnp.einsum("td,tkdi->tki", f(x), f(w.gate)[ex])
        u = jnp.einsum("td,tkdi->tki", f(x), f(w.up)[ex])
        y = jnp.einsum("tki,tkid->tkd", jax.nn.silu(g) * u, f(w.down)[ex])
        return jnp.einsum("tkd,tk->td", y, f(rw))


def sorted_moe(grouped, x, w: ExpertWeights, ex, rw):
    """Today's path with a pluggable `grouped(lhs, rhs, group_sizes)`: sort pairs, three grouped products."""
    tokens, k = ex.shape
    flat = ex.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]
    sizes = jnp.bincount(flat, length=w.gate.shape[0]).astype(jnp.int32)
    h = jax.nn.silu(grouped(xs, w.gate, sizes)) * grouped(xs, w.up, sizes)
    ys = grouped(h, w.down, sizes)
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(tokens, k, -1)
    return jnp.einsum("tkd,tk->td", y, rw)


def expert_loop(x, w: ExpertWeights, ex, rw):
    """Every expert over every token, masked by the routing weight: reads all experts whatever the routing."""
    dense_w = jnp.zeros((x.shape[0], w.gate.shape[0]), x.dtype).at[jnp.arange(x.shape[0])[:, None], ex].set(rw)

    def body(e, acc):
        h = jax.nn.silu(x @ w.gate[e]) * (x @ w.up[e])
        return acc + (h @ w.down[e]) * jax.lax.dynamic_slice_in_dim(dense_w, e, 1, axis=1)

    return jax.lax.fori_loop(0, w.gate.shape[0], body, jnp.zeros_like(x))


def rel_err(got, ref) -> float:
    """Largest error ÷ largest |reference|, in float32."""
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))


def ours(x, w, ex, rw, configs=None, layout="auto"):
    return moe_experts(x, w, ex, rw, act=jax.nn.silu, configs=configs, layout=layout)


LOOP_LAYERS = 16


def loop_device_us(key, x, w, tokens: int, layout: str, configs=None, real: int | None = None) -> float:
    """µs per layer of `LOOP_LAYERS` MoE layers in one jitted loop, each on its own random routing, the layer's
    output feeding the next: the device's time, which a single small call hides behind its host dispatch. `real`:
    only the first `real` tokens are routed (the rest is bucket padding, expert -1, as the engine routes it)."""
    keys = jax.random.split(key, LOOP_LAYERS)
    ex, rw = jax.vmap(lambda k: routing(k, tokens))(keys)
    if real is not None:
        ex = jax.vmap(lambda e: skip_padding(e, real))(ex)

    def run(x, w, ex, rw):
        body = lambda i, h: (h + ours(h, w, ex[i], rw[i], configs=configs, layout=layout) * 0.1).astype(h.dtype)
        return jax.lax.fori_loop(0, LOOP_LAYERS, body, x)

    return timeit(jax.jit(run), x, w, ex, rw) / LOOP_LAYERS * 1e6


def layout_loop_us(key, tokens: int, block_rows: int) -> dict:
    """µs per layer of the sorted layout (`routing.expert_tiles`) by comparison and by sort, each `LOOP_LAYERS`
    times in one jitted loop on its own routing: the device's time, not one call's dispatch."""
    keys = jax.random.split(key, LOOP_LAYERS)
    ex, rw = jax.vmap(lambda k: routing(k, tokens))(keys)
    out = {}
    for method in ("compare", "sort"):
        def run(ex, rw, method=method):
            def body(i, acc):
                tiles = expert_tiles(ex[i], rw[i], EXPERTS, block_rows, method)
                return acc + tiles.num_tiles[0] + tiles.slot_token[acc % tiles.slot_token.shape[0]]
            return jax.lax.fori_loop(0, LOOP_LAYERS, body, jnp.int32(0))
        out[f"layout_{method}_loop_us"] = timeit(jax.jit(run), ex, rw) / LOOP_LAYERS * 1e6
    return out


def router_loop_us(key, tokens: int) -> dict:
    """µs per layer of the router's softmax, top-k and renormalisation: XLA's ops and the one-launch kernel, each
    `LOOP_LAYERS` times in one jitted loop (each round's logits depend on the last's weights)."""
    from pallas_kernels.grouped_matmul.router import top_k_routing

    def xla(logits):
        w, e = jax.lax.top_k(jax.nn.softmax(logits), TOP_K)
        return w / w.sum(-1, keepdims=True), e

    logits = jax.random.normal(key, (tokens, EXPERTS), jnp.float32)
    out = {}
    fused = {f"fused_w{warps}": functools.partial(top_k_routing, k=TOP_K, normalize=True, num_warps=warps)
             for warps in (1, 2)}
    for name, fn in (("xla", xla), ("fused", lambda l: top_k_routing(l, TOP_K, True)), *fused.items()):
        def run(logits, fn=fn):
            def body(i, l):
                w, e = fn(l)
                return l + (jnp.sum(w) + jnp.sum(e).astype(jnp.float32)) * 1e-9
            return jax.lax.fori_loop(0, LOOP_LAYERS, body, logits)
        out[f"router_{name}_loop_us"] = timeit(jax.jit(run), logits) / LOOP_LAYERS * 1e6
    w, e = top_k_routing(logits, TOP_K, True)
    rw, re = xla(logits)
    out["router_fused_same_ids"] = bool(jnp.all(e == re))
    out["router_fused_max_weight_err"] = float(jnp.max(jnp.abs(w - rw)))
    return out


def correctness(key) -> dict:
    """Max error ÷ max |reference| for routings that stress the layout, bf16 and f32."""
    out = {}
    cases = {"random_t7": 7, "random_t300": 300, "one_expert_all_rows": 64, "skipped_ids": 33}
    for dtype in (jnp.bfloat16, jnp.float32):
        w = weights(key, dtype, e=16, d=256, i=192)
        for name, tokens in cases.items():
            kx, kr = jax.random.split(jax.random.fold_in(key, tokens))
            x = jax.random.normal(kx, (tokens, 256), dtype)
            ex, rw = routing(kr, tokens, e=16, k=4)
            if name == "one_expert_all_rows":
                ex = ex.at[:, 0].set(3)
            if name == "skipped_ids":
                ex = ex.at[::3, 1].set(-1)
            ref = reference(x, w, jnp.clip(ex, 0), jnp.where(ex >= 0, rw, 0))
            got = jax.jit(ours)(x, w, ex, rw)
            err = rel_err(got, ref)
            out[f"{jnp.dtype(dtype).name}_{name}"] = err
            log(f"correctness {jnp.dtype(dtype).name} {name}: rel err {err:.2e}")
            assert err < (2e-2 if dtype == jnp.bfloat16 else 2e-3), (name, err)
    return out


def distinct_experts(ex) -> int:
    return int(np.unique(np.asarray(ex)).size)


def expert_bytes(n_experts: int) -> int:
    return n_experts * 3 * HIDDEN * INTER * 2


def sweep_configs(tokens: int) -> list[tuple[TileConfig, TileConfig]]:
    if tokens * TOP_K / EXPERTS <= 16:  # 32-row tiles with K steps short enough for their stages
        cands = [TileConfig(rows, bn, bk, 4, st, WORKERS_PER_SM) for rows in (16, 32) for bn in (16, 32, 64)
                 for bk in (128, 256, 512) for st in (3, 4) if rows * bk <= 16 * 512]
    else:
        rows = (64, 128) if tokens >= 512 else (32, 64)
        cands = [TileConfig(r, bn, bk, wp, st, WORKERS_PER_SM) for r in rows for bn in (64, 128) for bk in (32, 64)
                 for wp in (4, 8) for st in (3, 4)]
        # the dense prefill's best tile (128 x 256, 8 warps: `invariant_matmul.WIDE`), for the one-accumulator down
        cands += [TileConfig(r, 256, 64, 8, 3, WORKERS_PER_SM) for r in rows if r >= 64]
    return cands


def _launch_kwargs(w: ExpertWeights, scale_block) -> tuple[dict, dict]:
    """The gate/up and down launches' storage arguments for `w` (none for float experts)."""
    up = dict(gate_scale=w.gate_scale, up_scale=w.up_scale, gate_zero=w.gate_zero, up_zero=w.up_zero,
              input_perm=w.input_perm, scale_block=scale_block)
    return up, dict(down_scale=w.down_scale, down_zero=w.down_zero, scale_block=scale_block)


def _fitted(cfg: TileConfig, w: ExpertWeights, scale_block) -> tuple[TileConfig, TileConfig]:
    """`cfg` with each launch's K step fitted to its storage (blocks and groups), as `moe_experts` fits it."""
    d, inter = w.gate.shape[1] * (8 if w.gate_zero is not None else 1), w.gate.shape[2]
    up = fit_steps(cfg, d, scaling_of(w.gate, d, w.gate_scale, w.gate_zero, scale_block))
    return up, fit_steps(cfg, inter, scaling_of(w.down, inter, w.down_scale, w.down_zero, scale_block))


def sweep(x, w, ex, rw, tokens: int, scale_block=None) -> tuple[tuple[TileConfig, TileConfig], dict]:
    """Each launch timed alone per candidate; the best gate/up and the best down at one block_rows."""
    best: dict[int, dict[str, tuple[float, TileConfig]]] = {}
    up_kw, down_kw = _launch_kwargs(w, scale_block)
    for candidate in sweep_configs(tokens):
        tiles = jax.jit(expert_tiles, static_argnums=(2, 3))(ex, rw, EXPERTS, candidate.block_rows)
        up_cfg, down_cfg = _fitted(candidate, w, scale_block)
        try:
            up = jax.jit(lambda x, g, u, t, c=up_cfg: expert_gate_up(x, g, u, t, act=jax.nn.silu, cfg=c, **up_kw))
            h = up(x, w.gate, w.up, tiles)
            t_up = timeit(up, x, w.gate, w.up, tiles, runs=3)
            down = jax.jit(lambda h, d, t, c=down_cfg: expert_down(h, d, t, cfg=c, **down_kw))
            t_down = timeit(down, h, w.down, tiles, runs=3)
        except Exception as e:  # a tile the compiler refuses (shared memory, registers): skip it
            log(f"  {candidate}: {type(e).__name__}: {str(e)[:120]}")
            continue
        log(f"  {up_cfg} / {down_cfg}: gate_up {t_up * 1e6:.1f} us, down {t_down * 1e6:.1f} us")
        slot = best.setdefault(candidate.block_rows, {})
        for part, t, cfg in (("up", t_up, up_cfg), ("down", t_down, down_cfg)):
            if part not in slot or t < slot[part][0]:
                slot[part] = (t, cfg)
    rows = min(best, key=lambda r: best[r]["up"][0] + best[r]["down"][0])
    chosen = (best[rows]["up"][1], best[rows]["down"][1])
    log(f"  sweep T={tokens}: best {chosen}")
    return chosen, {"up": str(chosen[0]), "down": str(chosen[1])}


def tokamax_grouped():
    try:
        import tokamax
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        log(f"tokamax unavailable: {type(e).__name__}: {e}")
        return None
    return lambda lhs, rhs, sizes: tokamax.ragged_dot(lhs, rhs, sizes, implementation="mosaic")


def jax_mgpu_grouped(block_m: int = 128, block_n: int = 128, block_k: int = 64, steps: int = 4, grid_block_n: int = 2):
    """jax's own Mosaic GPU ragged_dot for Hopper (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`: unpadded
    groups, one warpgroup a tile), at the tile its module's sweep starts from: a peer in every jax install."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return lambda lhs, rhs, sizes: ragged_dot_mgpu.ragged_dot(
        lhs, rhs, group_sizes=sizes, block_m=block_m, block_n=block_n, block_k=block_k,
        max_concurrent_steps=steps, grid_block_n=grid_block_n)


def time_layout(m: dict, order: str, x, w, ex, rw, ref, key, tokens: int) -> None:
    """One row layout's error against float32, per call and in the device loop, into `m`."""
    fn = jax.jit(lambda *a: ours(*a, layout=order))
    m[f"ours_{order}_rel_err"] = rel_err(fn(x, w, ex, rw), ref)
    assert m[f"ours_{order}_rel_err"] < 2e-2, m
    m[f"ours_{order}_us"] = timeit(fn, x, w, ex, rw) * 1e6
    m[f"ours_{order}_loop_us"] = loop_device_us(key, x, w, tokens, order)
    log(f"T={tokens} {order}: call {m[f'ours_{order}_us']:.1f} us, in a loop {m[f'ours_{order}_loop_us']:.1f}")


def time_layer(key, tokens: int, w, copy_rate: float, do_sweep: bool, tkx) -> tuple[dict, dict]:
    kx, kr = jax.random.split(jax.random.fold_in(key, tokens))
    x = jax.random.normal(kx, (tokens, HIDDEN), jnp.bfloat16)
    ex, rw = routing(kr, tokens)
    ref = reference(x, w, ex, rw) if tokens <= 256 else None
    m: dict = {}
    configs, m["tiles"] = sweep(x, w, ex, rw, tokens) if do_sweep else (None, str(tile_configs(tokens * TOP_K,
                                                                                                  EXPERTS)))
    cfg = configs or tile_configs(tokens * TOP_K, EXPERTS)
    layout = jax.jit(expert_tiles, static_argnums=(2, 3, 4))
    m["routing_layout_us"] = timeit(layout, ex, rw, EXPERTS, cfg[0].block_rows, "auto") * 1e6
    if tokens * TOP_K <= 4 * COMPARE_MAX_PAIRS:  # both ways, where the switch between them should sit
        for method in ("compare", "sort"):
            m[f"routing_layout_{method}_us"] = timeit(layout, ex, rw, EXPERTS, cfg[0].block_rows, method) * 1e6
    if tokens <= 64:  # both row layouts, one call each and in a device loop (where the switch between them sits)
        for order in ("sorted", "by_token"):
            try:
                time_layout(m, order, x, w, ex, rw, ref, kr, tokens)
            except Exception as e:  # noqa: BLE001 - the layout `auto` does not take here is reported, not fatal
                if order == layout_for(tokens, "auto"):
                    raise
                m[f"ours_{order}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"T={tokens} {order}: {m[f'ours_{order}_error']}")
    if tokens <= 256:
        m |= router_loop_us(kr, tokens)
        log(f"T={tokens} router: xla {m['router_xla_loop_us']:.1f} us, fused {m['router_fused_loop_us']:.1f} us")
    fns = {"ours": jax.jit(lambda *a: ours(*a, configs=configs)),
           "xla_ragged_dot": jax.jit(lambda *a: sorted_moe(jax.lax.ragged_dot, *a))}
    if tokens <= 256:
        fns["expert_loop"] = jax.jit(expert_loop)
    if tkx is not None:
        fns["tokamax_mosaic"] = jax.jit(lambda *a: sorted_moe(tkx, *a))
    if tokens >= 256:  # prefill-sized: tiles of 128 rows
        fns["jax_ragged_dot_mgpu"] = jax.jit(lambda *a: sorted_moe(jax_mgpu_grouped(), *a))
    for name, fn in fns.items():
        try:
            out = fn(x, w, ex, rw)
            if ref is not None:
                m[f"{name}_rel_err"] = rel_err(out, ref)
            m[f"{name}_us"] = timeit(fn, x, w, ex, rw) * 1e6
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, ours must not
            if name == "ours":
                raise
            m[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        log(f"T={tokens} {name}: {m.get(f'{name}_us', m.get(f'{name}_error'))}")
    n_exp = distinct_experts(ex)
    floor_bytes = expert_bytes(n_exp) + 2 * tokens * HIDDEN * 2
    m["distinct_experts"] = n_exp
    m["floor_us"] = floor_bytes / copy_rate * 1e6
    r = {f"moe_layer_t{tokens}_vs_floor": m["ours_us"] / m["floor_us"],
         f"moe_layer_t{tokens}_xla_vs_ours": m["xla_ragged_dot_us"] / m["ours_us"]}
    if "tokamax_mosaic_us" in m:
        r[f"moe_kernel_vs_tokamax_t{tokens}"] = m["tokamax_mosaic_us"] / m["ours_us"]
    if "jax_ragged_dot_mgpu_us" in m:
        r[f"moe_kernel_vs_jax_mgpu_t{tokens}"] = m["jax_ragged_dot_mgpu_us"] / m["ours_us"]
    if "ours_by_token_loop_us" in m:  # > 1: the by-token layout is the faster at this size
        r[f"moe_layer_t{tokens}_by_token_vs_sorted"] = m["ours_sorted_loop_us"] / m["ours_by_token_loop_us"]
    auto_loop = f"ours_{layout_for(tokens, 'auto')}_loop_us"
    if auto_loop in m:  # the default layout's device time against the floor (a single call may time the host)
        r[f"moe_layer_t{tokens}_device_vs_floor"] = m[auto_loop] / m["floor_us"]
    if "router_fused_loop_us" in m:
        r[f"moe_router_t{tokens}_fused_vs_xla"] = m["router_xla_loop_us"] / m["router_fused_loop_us"]
    flops = 2 * tokens * TOP_K * HIDDEN * INTER * 3
    m["ours_tflops"] = flops / m["ours_us"] * 1e-6
    return m, r


INT4_GROUP, FP8_BLOCK = 128, 128


def _expert_shapes(d=HIDDEN, i=INTER) -> tuple[tuple[int, int], ...]:
    return ((d, i), (d, i), (i, d))


def int4_weights(key, e=EXPERTS, d=HIDDEN, i=INTER) -> tuple[ExpertWeights, ExpertWeights, dict]:
    """(packed 4-bit experts, their dequantized bf16 twin, moe_experts kwargs) with random values, zero points and
    scales."""
    packed, scales, zeros, dense = [], [], [], []
    for j, (k, n) in enumerate(_expert_shapes(d, i)):
        kq, kz, ks = jax.random.split(jax.random.fold_in(key, j), 3)
        words = jax.random.bits(kq, (e, k // 8, n), jnp.uint32).view(jnp.int32)
        zero = jax.random.randint(kz, (e, k // INT4_GROUP, n), 0, 16).astype(jnp.float16)
        scale = (jax.random.uniform(ks, (e, k // INT4_GROUP, n), minval=0.5, maxval=1.5) * k ** -0.5 / 4
                 ).astype(jnp.float16)
        packed.append(words), zeros.append(zero), scales.append(scale)
        shifts = 4 * jnp.arange(8, dtype=jnp.int32)
        q = ((words[:, :, None, :] >> shifts[None, None, :, None]) & 15).reshape(e, k, n).astype(jnp.float32)
        rows = jnp.arange(k) // INT4_GROUP
        dense.append(((q - zero[:, rows].astype(jnp.float32)) * scale[:, rows].astype(jnp.float32)
                      ).astype(jnp.bfloat16))
    return ExpertWeights(*packed, *scales, *zeros), ExpertWeights(*dense), {}


def fp8_block_weights(key, e=EXPERTS, d=HIDDEN, i=INTER) -> tuple[ExpertWeights, ExpertWeights, dict]:
    """(float8 experts with 128 × 128 block scales, their dequantized bf16 twin, moe_experts kwargs)."""
    values, scales, dense = [], [], []
    for j, (k, n) in enumerate(_expert_shapes(d, i)):
        kv, ks = jax.random.split(jax.random.fold_in(key, j))
        w = jax.random.normal(kv, (e, k, n), jnp.float32).astype(jnp.float8_e4m3fn)
        scale = jax.random.uniform(ks, (e, k // FP8_BLOCK, n // FP8_BLOCK), minval=0.5, maxval=1.5) * k ** -0.5
        full = jnp.repeat(jnp.repeat(scale, FP8_BLOCK, axis=1), FP8_BLOCK, axis=2)
        values.append(w), scales.append(scale), dense.append((w.astype(jnp.float32) * full).astype(jnp.bfloat16))
    return ExpertWeights(*values, *scales), ExpertWeights(*dense), {"scale_block": (FP8_BLOCK, FP8_BLOCK)}


NARROW = {"int4": int4_weights, "fp8_block": fp8_block_weights}


def expert_nbytes(w: ExpertWeights) -> int:
    """One expert's bytes in its stored format (weights, scales, zero points)."""
    return sum(a.nbytes // a.shape[0] for a in w if a is not None)


def time_narrow_layer(kind: str, key, tokens: int, narrow: ExpertWeights, w16: ExpertWeights, kwargs: dict,
                      copy_rate: float, do_sweep: bool = False) -> tuple[dict, dict]:
    """The quantized layer beside the bf16 one on the same routing; checked first against float32 on the
    dequantized weights (bf16 rounding of the weight tile and the hidden rows: 2e-2 of the largest output)."""
    kx, kr = jax.random.split(jax.random.fold_in(key, tokens))
    x = jax.random.normal(kx, (tokens, HIDDEN), jnp.bfloat16)
    ex, rw = routing(kr, tokens)
    m: dict = {}
    configs = None
    if do_sweep:  # the tiles this storage prefers, each launch's K step fitted to it
        configs, m["tiles"] = sweep(x, narrow, ex, rw, tokens, kwargs.get("scale_block"))
    fn = jax.jit(lambda x, w, ex, rw: moe_experts(x, w, ex, rw, act=jax.nn.silu, configs=configs, **kwargs))
    if tokens <= 256:
        ref = reference(x, w16, ex, rw)
        m["rel_err"] = rel_err(fn(x, narrow, ex, rw), ref)
        assert m["rel_err"] < 2e-2, m
    m["us"] = timeit(fn, x, narrow, ex, rw) * 1e6
    m["bf16_us"] = timeit(jax.jit(ours), x, w16, ex, rw) * 1e6
    n_exp = distinct_experts(ex)
    m["distinct_experts"] = n_exp
    m["floor_us"] = (n_exp * expert_nbytes(narrow) + 2 * tokens * HIDDEN * 2) / copy_rate * 1e6
    log(f"T={tokens} {kind} {m['us']:.1f} us (floor {m['floor_us']:.1f}), bf16 {m['bf16_us']:.1f} us")
    return m, {f"moe_{kind}_layer_t{tokens}_vs_floor": m["us"] / m["floor_us"],
               f"moe_{kind}_layer_t{tokens}_vs_bf16": m["bf16_us"] / m["us"]}


def main_narrow(args, key) -> None:
    _, copy_rate = copy_bandwidth()
    metrics: dict = {"copy_bandwidth_gbs": copy_rate / 1e9}
    ratios: dict = {}
    for kind in args.narrow:
        narrow, w16, kwargs = NARROW[kind](jax.random.fold_in(key, 11))
        for tokens in args.tokens:
            m, r = time_narrow_layer(kind, key, tokens, narrow, w16, kwargs, copy_rate, args.sweep)
            metrics[f"layer_{kind}_t{tokens}"] = m
            ratios |= r
        save(args.out, args.git_sha, metrics, ratios)
    log(ratios)


def with_workers(tokens: int, workers_per_sm: int) -> tuple[TileConfig, TileConfig]:
    """The default tiles of a `tokens`-token step with `workers_per_sm` (0: one program per tile)."""
    return tuple(dataclasses.replace(c, workers_per_sm=workers_per_sm) for c in tile_configs(tokens * TOP_K, EXPERTS))


def main_workers(args, key) -> None:
    """The layer in the device loop at each grid (`TileConfig.workers_per_sm`) and step size, each checked against
    float32 first; `b1_in_16` is one real token in the engine's smallest bucket (16 rows, 15 routed nowhere)."""
    _, copy_rate = copy_bandwidth()
    w = weights(jax.random.fold_in(key, 7))
    metrics: dict = {"copy_bandwidth_gbs": copy_rate / 1e9}
    ratios: dict = {}
    cases = [(f"t{t}", t, None) for t in args.tokens] + [("b1_in_16", 16, 1)]
    for name, tokens, real in cases:
        kx, kr = jax.random.split(jax.random.fold_in(key, tokens))
        x = jax.random.normal(kx, (tokens, HIDDEN), jnp.bfloat16)
        ex, rw = routing(kr, tokens)
        if real is not None:
            ex = skip_padding(ex, real)
        n_exp = distinct_experts(ex[: real or tokens])
        m = {"distinct_experts": n_exp, "floor_us": expert_bytes(n_exp) / copy_rate * 1e6}
        for wps in args.workers:
            cfg = with_workers(tokens, wps)
            try:
                if tokens <= 256:  # the real rows against float32 (the reference would gather expert -1)
                    got = jax.jit(lambda *a, c=cfg: ours(*a, configs=c))(x, w, ex, rw)
                    n = real or tokens
                    err = rel_err(got[:n], reference(x[:n], w, ex[:n], rw[:n]))
                    assert err < 2e-2, (name, wps, err)
                    m[f"w{wps}_rel_err"] = err
                m[f"w{wps}_loop_us"] = loop_device_us(kr, x, w, tokens, "auto", cfg, real)
            except Exception as e:  # noqa: BLE001 - a grid the compiler refuses is reported, the others still run
                m[f"w{wps}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"{name} workers/SM {wps}: {m.get(f'w{wps}_loop_us', m.get(f'w{wps}_error'))} "
                f"(floor {m['floor_us']:.1f} us)")
        if tokens <= 256 and real is None:  # the router's launches beside the experts'
            m |= router_loop_us(kr, tokens)
        if layout_for(tokens, "auto") == "sorted" and tokens * TOP_K <= 4 * COMPARE_MAX_PAIRS:
            m |= layout_loop_us(kr, tokens, tile_configs(tokens * TOP_K, EXPERTS)[0].block_rows)
        log({key: v for key, v in m.items() if key.startswith(("router", "layout"))})
        metrics[f"grid_{name}"] = m
        for wps in args.workers:
            if wps and f"w{wps}_loop_us" in m and "w0_loop_us" in m:
                ratios[f"moe_layer_{name}_w{wps}_vs_w0"] = m["w0_loop_us"] / m[f"w{wps}_loop_us"]
        save(args.out, args.git_sha, metrics, ratios)
    log(ratios)


# At 13bb250 (an H100) the first two were the fastest at 4,096 and at 256-1,024 tokens; the rest are
# warp-specialised (a memory warpgroup, two compute warpgroups of 64 rows: wider gate/up tiles fit)
MOSAIC_CANDIDATES = ("128,64,128,64,3", "64,128,256,64,4", "128,128,256,64,3,ws", "128,128,128,64,4,ws",
                     "128,64,128,64,4,ws")


def mosaic_tiles(candidate: str):
    """`R,NU,ND,K,C[,ws]` → the (gate/up, down) tiles; `ws`: warp-specialised."""
    fields = candidate.split(",")
    specialized = fields[-1] == "ws"
    rows, n_up, n_down, k, steps = (int(v) for v in fields[:5])
    return (mosaic.MosaicTiles(rows, n_up, k, steps, specialized),
            mosaic.MosaicTiles(rows, n_down, k, steps, specialized))


def main_mosaic(args, key) -> None:
    """The Mosaic GPU kernels' candidates beside the Triton kernels, per token count (module docstring)."""
    _, copy_rate = copy_bandwidth()
    rate = matmul_rate()
    metrics: dict = {"copy_bandwidth_gbs": copy_rate / 1e9, "matmul_tflops": rate / 1e12}
    ratios: dict = {}
    w = weights(jax.random.fold_in(key, 7))
    for tokens in args.tokens:
        kx, kr = jax.random.split(jax.random.fold_in(key, tokens))
        x = jax.random.normal(kx, (tokens, HIDDEN), jnp.bfloat16)
        ex, rw = routing(kr, tokens)
        flops = 2 * tokens * TOP_K * HIDDEN * INTER * 3
        triton = jax.jit(lambda *a: ours(*a, layout="sorted"))
        want = reference(x, w, ex, rw) if tokens <= 256 else triton(x, w, ex, rw).astype(jnp.float32)
        m: dict = {"triton_us": timeit(triton, x, w, ex, rw) * 1e6}
        for candidate in args.mosaic:
            name = f"mosaic_{candidate.replace(',', '_')}"
            try:
                tiles = mosaic_tiles(candidate)
                if not mosaic.fits(HIDDEN, INTER, tiles):  # the layer would run the Triton kernels instead
                    raise ValueError(f"{tiles} do not fit hidden {HIDDEN}, width {INTER}")
                fn = jax.jit(lambda *a, t=tiles: moe_experts(*a, act=jax.nn.silu, layout="sorted", mosaic_tiles=t))
                m[f"{name}_rel_err"] = rel_err(fn(x, w, ex, rw), want)
                assert m[f"{name}_rel_err"] < 2e-2, (name, m[f"{name}_rel_err"])
                m[f"{name}_us"] = timeit(fn, x, w, ex, rw) * 1e6
                m[f"{name}_tflops"] = flops / m[f"{name}_us"] * 1e-6
            except Exception as e:  # noqa: BLE001 - a candidate the compiler refuses is reported, the rest still run
                m[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"T={tokens} {name}: {m.get(f'{name}_us', m.get(f'{name}_error'))} (Triton {m['triton_us']:.1f} us)")
        timed = {key[:-3]: v for key, v in m.items() if key.startswith("mosaic_") and key.endswith("_us")}
        if timed:
            best = min(timed, key=timed.get)
            m["best"] = best
            ratios[f"moe_layer_t{tokens}_mosaic_vs_triton"] = m["triton_us"] / timed[best]
            if tokens == 4096:
                ratios["moe_prefill_mosaic_vs_matmul_rate"] = flops / (timed[best] * 1e-6) / rate
        metrics[f"mosaic_t{tokens}"] = m
        save(args.out, args.git_sha, metrics, ratios)
    log(ratios)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    ap.add_argument("--git-sha", default="unknown", help="the commit measured (the GPU machine has no .git)")
    ap.add_argument("--narrow", nargs="+", choices=tuple(NARROW), help="quantized experts beside bf16 ones "
                    "(see the module docstring)")
    ap.add_argument("--workers", type=int, nargs="+", help="only the grid comparison: the layer at each of these "
                    "workers_per_sm (0: one program per tile) at --tokens and one token in a 16-row bucket")
    ap.add_argument("--mosaic", nargs="*", help="only the Mosaic GPU kernels' candidates (module docstring; none "
                    f"named: {' '.join(MOSAIC_CANDIDATES)}) beside the Triton kernels")
    args = ap.parse_args()
    key = jax.random.key(0)
    if args.mosaic is not None:
        args.mosaic = args.mosaic or list(MOSAIC_CANDIDATES)
        if args.tokens == list(TOKENS):
            args.tokens = [256, 1024, 4096]
        return main_mosaic(args, key)
    if args.workers:
        return main_workers(args, key)
    if args.narrow:
        return main_narrow(args, key)
    metrics: dict = {"correctness_rel_err": correctness(key)}
    _, copy_rate = copy_bandwidth()
    rate = matmul_rate()
    metrics |= {"copy_bandwidth_gbs": copy_rate / 1e9, "matmul_tflops": rate / 1e12}
    log(f"copy {copy_rate / 1e9:.0f} GB/s, matmul {rate / 1e12:.0f} TFLOP/s")
    w = weights(jax.random.fold_in(key, 7))
    tkx = tokamax_grouped()
    ratios: dict = {}
    for tokens in args.tokens:
        m, r = time_layer(key, tokens, w, copy_rate, args.sweep, tkx)
        metrics[f"layer_t{tokens}"] = m
        ratios |= r
        save(args.out, args.git_sha, metrics, ratios, extra_versions=("tokamax",))  # kept if a later size fails
    if 4096 in args.tokens:
        ratios["moe_prefill_vs_matmul_rate"] = metrics["layer_t4096"]["ours_tflops"] * 1e12 / rate
        if "moe_kernel_vs_tokamax_t4096" in ratios:
            ratios["moe_kernel_vs_tokamax_prefill_4k"] = ratios["moe_kernel_vs_tokamax_t4096"]
    if "moe_kernel_vs_tokamax_t64" in ratios:
        ratios["moe_kernel_vs_tokamax_decode_b64"] = ratios["moe_kernel_vs_tokamax_t64"]
    save(args.out, args.git_sha, metrics, ratios, extra_versions=("tokamax",))
    log(ratios)


if __name__ == "__main__":
    main()
