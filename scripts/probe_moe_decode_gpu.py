"""Where a decode-sized MoE layer's time goes on the GPU: the gate/up and down launches timed apart, per tile
configuration, beside a dense matmul over the same bytes and the router's launches.

    PYTHONPATH=. python scripts/probe_moe_decode_gpu.py --out DIR/probe-moe-decode.json
    ncu --clock-control none -k regex:expert --csv --metrics gpu__time_duration.sum \\
        python scripts/probe_moe_decode_gpu.py --ncu --order DIR/order.json  # each variant once per case

Cases (one Qwen3-30B-A3B layer, random bf16 weights and routing): `lone` (1 token), `bucket` (the engine's
16-row bucket holding one real token, 15 routed nowhere) and `t16` (16 real tokens). Each launch runs `LOOP`
times in one jitted loop on a fresh routing per round (the device's time, not the host's dispatch), after its
output was checked against float32. Each round also pays the device loop's own step, which `empty_us` times
alone (10-15 µs on an H100, as much as a decode launch): the launches' own times are the ncu figures.
`dense_same_bytes_us`: XLA's dot of the rows with one contiguous weight of the routed experts' bytes, the best a
plain matmul does with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe_kernels import EXPERTS, HIDDEN, INTER, TOP_K, reference, rel_err, routing, weights  # noqa: E402
from gpu_bench_common import copy_bandwidth, log, timeit  # noqa: E402

from jengine.layers.mlp import skip_padding  # noqa: E402
from pallas_kernels.grouped_matmul import TileConfig, tile_configs  # noqa: E402
from pallas_kernels.grouped_matmul.kernel import TokenChoices, expert_down, expert_gate_up  # noqa: E402
from pallas_kernels.grouped_matmul.combine import combine_pairs  # noqa: E402
from pallas_kernels.grouped_matmul.router import ChosenExperts  # noqa: E402

LOOP = 16
CASES = {"lone": (1, 1), "bucket": (16, 1), "t16": (16, 16)}  # name: (rows, real tokens)


def variants() -> dict[str, tuple[TileConfig, TileConfig]]:
    """Decode tiles to compare: the default (one 4-warp program an SM fits its shared memory) and ones that fit
    two or three an SM, more of them, or narrower column tiles (more tiles to spread over the SMs)."""
    up, down = tile_configs(16 * TOP_K, EXPERTS)

    def both(**kw):
        return dataclasses.replace(up, **kw), dataclasses.replace(down, **kw)

    return {
        "default": (up, down),
        "stages3": both(num_stages=3),
        "k128": both(block_k=128),
        "k128_w3": both(block_k=128, workers_per_sm=3),
        "k128_s6_w3": both(block_k=128, num_stages=6, workers_per_sm=3),
        "k64_s8_w4": both(block_k=64, num_stages=8, workers_per_sm=4),
        "k128_warps2_w4": both(block_k=128, num_warps=2, workers_per_sm=4),
        "n16_k256_s3_w4": (dataclasses.replace(up, block_n=16, num_stages=3, workers_per_sm=4),
                           dataclasses.replace(down, block_n=32, num_stages=3, workers_per_sm=4)),
        "k128_grid": both(block_k=128, workers_per_sm=0),
    }


def routings(key, rows: int, real: int, n: int):
    ex, rw = jax.vmap(lambda k: routing(k, rows))(jax.random.split(key, n))
    ex = jax.vmap(lambda e: skip_padding(e, real))(ex)
    return ex, rw


def choices(ex, rw, listed: bool = False) -> TokenChoices:
    """The by-token operands; `listed`: with the distinct chosen experts, as the fused router lists them."""
    chosen = None
    if listed:
        distinct = np.unique(np.asarray(ex)[np.asarray(ex) >= 0])
        ids = np.full(EXPERTS, -1, np.int32)
        ids[:len(distinct)] = distinct
        chosen = ChosenExperts(jnp.asarray(ids), jnp.asarray([len(distinct)], jnp.int32))
    return TokenChoices(ex, rw.reshape(-1).astype(jnp.float32), chosen)


def launches(w, cfgs):
    up_cfg, down_cfg = cfgs
    gate_up = functools.partial(expert_gate_up, w_gate=w.gate, w_up=w.up, act=jax.nn.silu, cfg=up_cfg)
    down = functools.partial(expert_down, w_down=w.down, cfg=down_cfg)
    return gate_up, down


def loop_us(step, *args) -> float:
    """µs per round of `step(i, *args) -> scalar` over LOOP rounds in one jitted loop."""
    def run(*a):
        return jax.lax.fori_loop(0, LOOP, lambda i, acc: acc + step(i, *a), jnp.float32(0))
    return timeit(jax.jit(run), *args) / LOOP * 1e6


def time_case(key, w, rows: int, real: int, cfgs) -> dict:
    gate_up, down = launches(w, cfgs)
    kx, kr = jax.random.split(key)
    x = jax.random.normal(kx, (rows, HIDDEN), jnp.bfloat16)
    ex, rw = routings(kr, rows, real, LOOP)
    got = jax.jit(lambda x, e, r: combine_pairs(down(gate_up(x, tiles=choices(e, r)), tiles=choices(e, r)), e,
                                                EXPERTS))(x, ex[0], rw[0])
    err = rel_err(got[:real], reference(x[:real], w, ex[0, :real], rw[0, :real]))
    assert err < 2e-2, err
    h = gate_up(x, tiles=choices(ex[0], rw[0]))
    out = {"rel_err": err}
    out["gate_up_us"] = loop_us(lambda i, x, e, r: gate_up(x, tiles=choices(e[i], r[i]))[0, 0].astype(jnp.float32),
                                x, ex, rw)
    out["down_us"] = loop_us(lambda i, h, e, r: down(h, tiles=choices(e[i], r[i]))[0, 0].astype(jnp.float32),
                             h, ex, rw)
    out["empty_us"] = loop_us(lambda i, x, e, r: (x[0, 0] + e[i, 0, 0]).astype(jnp.float32), x, ex, rw)
    return out


def dense_same_bytes_us(key, rows: int) -> float:
    """XLA's dot of `rows` rows with LOOP distinct contiguous weights of 8 experts' gate/up/down bytes each."""
    ws = [jax.random.normal(k, (HIDDEN, TOP_K * 3 * INTER), jnp.bfloat16) for k in jax.random.split(key, LOOP)]
    x = jax.random.normal(key, (rows, HIDDEN), jnp.bfloat16)

    def run(x, *ws):
        return sum(jnp.dot(x, w)[0, 0].astype(jnp.float32) for w in ws)
    return timeit(jax.jit(run), x, *ws) / LOOP * 1e6


def router_us(key, rows: int) -> dict:
    from pallas_kernels.grouped_matmul.router import top_k_routing

    logits = jax.random.normal(key, (LOOP, rows, EXPERTS), jnp.float32)

    def xla(l):
        p, e = jax.lax.top_k(jax.nn.softmax(l), TOP_K)
        return p / p.sum(-1, keepdims=True), e

    out = {}
    for name, fn in (("xla", xla), *((f"fused_w{n}", functools.partial(top_k_routing, k=TOP_K, normalize=True,
                                                                         num_warps=n)) for n in (1, 4))):
        out[f"router_{name}_us"] = loop_us(lambda i, l, fn=fn: fn(l[i])[0][0, 0], logits)
    return out


def ncu_launches(names: list[str], cases: list[str], order_path: str | None) -> None:
    """Each variant's two launches once per case, nothing timed: for `ncu -k regex:expert_`, whose report lists
    them in the order written to `order_path`."""
    key = jax.random.key(0)
    w = weights(key)
    order = []
    for name in names:
        gate_up, down = launches(w, variants()[name])
        for case in cases:
            rows, real = CASES[case.removesuffix("_listed")]
            x = jax.random.normal(key, (rows, HIDDEN), jnp.bfloat16)
            ex, rw = routings(jax.random.fold_in(key, len(order)), rows, real, 1)
            tiles = choices(ex[0], rw[0], listed=case.endswith("_listed"))
            jax.block_until_ready(down(jax.block_until_ready(gate_up(x, tiles=tiles)), tiles=tiles))
            order += [f"{name}/{case}/gate_up", f"{name}/{case}/down"]
    if order_path:
        Path(order_path).write_text(json.dumps(order))


def ncu_router(warps: list[int], order_path: str | None, tokens: tuple[int, ...] = (16, 256)) -> None:
    """The fused router once per (listing, warp count, token count), the engine's 16-token bucket and a 256-token
    step, nothing timed: for `ncu -k regex:moe_top_k`, whose report lists them in the order written to
    `order_path`."""
    from pallas_kernels.grouped_matmul.router import BLOCK_TOKENS, top_k_routing, top_k_routing_listed

    order = []
    for t in tokens:
        logits = jax.random.normal(jax.random.key(t), (t, EXPERTS), jnp.float32)
        for listed in (False, True) if t <= BLOCK_TOKENS else (False,):
            fn = top_k_routing_listed if listed else top_k_routing
            for n in warps:
                jax.block_until_ready(fn(logits, TOP_K, True, num_warps=n))
                order.append(f"router{'_listed' if listed else ''}_w{n}_t{t}")
    if order_path:
        Path(order_path).write_text(json.dumps(order))


def ncu_dense(order_path: str | None) -> None:
    """XLA's dot of 16 rows with one contiguous weight of 8 experts' gate/up bytes ([2048, 12288]) and of their
    down bytes ([6144, 2048]), twice each, inputs made on the host: for `ncu` with no kernel filter (nothing else
    runs on the device), the best a plain matmul does with the bytes the decode launches read."""

    rng = np.random.default_rng(0)
    order = []
    for name, (k, n) in (("dense_gate_up", (HIDDEN, 2 * TOP_K * INTER)), ("dense_down", (TOP_K * INTER, HIDDEN))):
        x = jax.device_put(rng.standard_normal((16, k)).astype(jnp.bfloat16))
        w = jax.device_put(rng.standard_normal((k, n)).astype(jnp.bfloat16))
        for _ in range(2):
            jax.block_until_ready(jax.jit(jnp.dot)(x, w))
            order.append(name)
    if order_path:
        Path(order_path).write_text(json.dumps(order))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--variants", nargs="*")
    ap.add_argument("--cases", nargs="*", default=list(CASES), help="--ncu: also NAME_listed (the chosen experts "
                    "listed, as PallasExperts.list_chosen routes them)")
    ap.add_argument("--order", help="--ncu: where to write the launches' order")
    ap.add_argument("--ncu-router", type=int, nargs="*", help="--ncu: the fused router at these warp counts instead")
    ap.add_argument("--ncu-dense", action="store_true", help="--ncu: XLA's dense dots over the same bytes instead")
    args = ap.parse_args()
    if args.ncu and args.ncu_dense:
        return ncu_dense(args.order)
    if args.ncu and args.ncu_router:
        return ncu_router(args.ncu_router, args.order)
    if args.ncu:
        return ncu_launches(args.variants or list(variants()), args.cases, args.order)
    key = jax.random.key(0)
    _, copy_rate = copy_bandwidth()
    w = weights(key)
    floor_us = TOP_K * 3 * HIDDEN * INTER * 2 / copy_rate * 1e6
    result = {"device": jax.devices()[0].device_kind, "copy_bandwidth_gbs": copy_rate / 1e9,
              "floor_8_experts_us": floor_us, "dense_same_bytes_us": dense_same_bytes_us(key, 16),
              "router": router_us(key, 16)}
    log({k: v for k, v in result.items()})
    for name, cfgs in variants().items():
        if args.variants and name not in args.variants:
            continue
        for case, (rows, real) in CASES.items():
            try:
                r = time_case(jax.random.fold_in(key, rows * 100 + real), w, rows, real, cfgs)
            except Exception as e:  # noqa: BLE001 - a tile the compiler refuses is reported, the rest still run
                r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            result[f"{name}/{case}"] = r
            log(name, case, {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
