"""Which grid reads a decode step's expert weights fastest: a batched GEMV over 8 experts' slabs, as the by-token MoE
launches read them at one token, in the layouts a kernel could take.

    ncu --clock-control none -k regex:gemv_ --csv --metrics gpu__time_duration.sum,\\
        dram__throughput.avg.pct_of_peak_sustained_elapsed python scripts/probe_gemv_gpu.py --order DIR/order.json
    PYTHONPATH=. python scripts/probe_gemv_gpu.py --check   # every variant against float32, interpret mode on a CPU

Shapes: x `[8, 16, K]` (16 rows, as the engine's smallest bucket) times W `[8, K, N]` (bf16, each expert's slab
contiguous): gate/up's (K 2048, N 1536) and down's (K 768, N 2048) of Qwen3-30B-A3B. Variants:
  * `columns`: program (expert, column tile) walks all of K, `[block_k, block_n]` steps: the current launches'
    grid (64- or 128-byte rows of W per step, the tiles of one expert reading the same rows together);
  * `split_k`: program (expert, column tile, K slice of `slice_rows`) walks its slice with wider column tiles (256
    to 1024 bytes a row) and adds its partial into a float32 output with atomics (more programs, longer contiguous
    runs of W).
Under ncu the report lists the launches in the order written to `--order`. cuBLAS's dot of the same bytes
(`probe_moe_decode_gpu.py --ncu-dense`) took 20.1 µs for gate/up on an H100 (75 % of the DRAM peak), the current
gate/up launch 25.6 (61 %).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

EXPERTS, ROWS = 8, 16
SHAPES = {"gate_up": (2048, 1536), "down": (768, 2048)}


class Variant(NamedTuple):
    grid: str  # columns | split_k
    block_n: int
    block_k: int
    slice_rows: int = 0  # split_k: K rows per program (0: all of K)
    num_warps: int = 4
    num_stages: int = 4


VARIANTS = {
    "columns_n32_k256": Variant("columns", 32, 256),
    "columns_n64_k128": Variant("columns", 64, 128),
    "split_k_n128_k64_r256": Variant("split_k", 128, 64, 256),
    "split_k_n256_k32_r256": Variant("split_k", 256, 32, 256, num_warps=8),
    "split_k_n256_k64_r128": Variant("split_k", 256, 64, 128, num_warps=8),
    "split_k_n512_k16_r128": Variant("split_k", 512, 16, 128, num_warps=8),
}


def _kernel(*refs, v: Variant, k_dim: int, block_n: int, atomic: bool):
    x_ref, w_ref, out_ref = refs[0], refs[1], refs[-1]  # atomic: refs[2] is the zeroed output, aliased to out_ref
    e, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = jnp.arange(ROWS, dtype=jnp.int32)
    cols = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    span = v.slice_rows or k_dim
    steps = span // v.block_k

    def step(i, acc):
        ks = s * span + i * v.block_k + jnp.arange(v.block_k, dtype=jnp.int32)
        x = pltr.load(x_ref.at[e, rows[:, None], ks[None, :]])
        w = pltr.load(w_ref.at[e, ks[:, None], cols[None, :]])
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((ROWS, block_n), jnp.float32))
    index = (e, rows[:, None], cols[None, :])
    if atomic:
        pltr.atomic_add(out_ref, index, acc)
    else:
        pltr.store(out_ref.at[index], acc)


@functools.partial(jax.jit, static_argnames=("v", "interpret"))
def gemv(x: jax.Array, w: jax.Array, v: Variant, interpret: bool = False) -> jax.Array:
    """x `[E, ROWS, K]` @ w `[E, K, N]` → float32 `[E, ROWS, N]` by the grid `v`."""
    experts, k_dim, n_dim = w.shape
    span = v.slice_rows or k_dim
    if n_dim % v.block_n or k_dim % span or span % v.block_k:
        raise ValueError(f"{v} does not tile K={k_dim}, N={n_dim}")
    block_n, splits = v.block_n, k_dim // span
    atomic = splits > 1
    out_shape = jax.ShapeDtypeStruct((experts, ROWS, n_dim), jnp.float32)
    call = pl.pallas_call(
        functools.partial(_kernel, v=v, k_dim=k_dim, block_n=block_n, atomic=atomic),
        grid=(experts, n_dim // block_n, splits),
        in_specs=[pl.no_block_spec] * (3 if atomic else 2),
        out_specs=pl.no_block_spec,
        out_shape=out_shape,
        input_output_aliases={2: 0} if atomic else {},
        compiler_params=pltr.CompilerParams(num_warps=v.num_warps, num_stages=v.num_stages),
        interpret=interpret,
        name=f"gemv_{v.grid}",
    )
    return call(x, w, jnp.zeros(out_shape.shape, jnp.float32)) if atomic else call(x, w)


def operands(key, shape: str):
    k_dim, n_dim = SHAPES[shape]
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (EXPERTS, ROWS, k_dim), jnp.bfloat16)
    w = (jax.random.normal(kw, (EXPERTS, k_dim, n_dim), jnp.float32) * k_dim ** -0.5).astype(jnp.bfloat16)
    return x, w


def check(interpret: bool, order: list[str]) -> dict[str, float]:
    """Each variant's largest relative error against a float32 einsum, on both shapes (its launches appended to
    `order`)."""
    errors = {}
    for shape in SHAPES:
        x, w = operands(jax.random.key(1), shape)
        want = np.asarray(jnp.einsum("emk,ekn->emn", x.astype(jnp.float32), w.astype(jnp.float32),
                                     precision=jax.lax.Precision.HIGHEST))
        for name, v in VARIANTS.items():
            got = np.asarray(gemv(x, w, v, interpret=interpret))
            order.append(f"check/{name}/{shape}")
            errors[f"{name}/{shape}"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    return errors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="correctness only (interpret mode off a GPU)")
    ap.add_argument("--order", help="where to write the launches' order (for the ncu report)")
    args = ap.parse_args()
    on_gpu = jax.devices()[0].platform == "gpu"
    order: list[str] = []
    errors = check(not on_gpu, order)
    print(json.dumps(errors, indent=1))
    assert max(errors.values()) < 1e-2, errors
    if args.check:
        return
    for shape in SHAPES:
        x, w = operands(jax.random.key(2), shape)
        for name, v in VARIANTS.items():
            for _ in range(2):  # the second launch is the one to read (the first may pay a cold instruction cache)
                jax.block_until_ready(gemv(x, w, v))
                order.append(f"{name}/{shape}")
    if args.order:
        Path(args.order).write_text(json.dumps(order))


if __name__ == "__main__":
    main()
