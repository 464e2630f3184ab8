"""`x @ w` (or `x @ wᵀ`) with a row's result independent of the other rows: batch invariance.

cuBLAS and XLA pick a GEMM algorithm (tile shape, split-K, stream-K) by the problem's shape, so a token's logits
change with the number of rows beside it. Here K is never split: each output is one float32 accumulator that walks K
from its first element to its last, and on the tensor cores each MMA adds its 16-wide slice of K to that
accumulator, so the order of additions is the same chain of slices whatever the program's output tile and however
many slices a loop step loads (`block_k`). The tile is therefore free to follow the shape (`tile_for`): narrow tiles
with long K steps for decode rows (enough programs to fill the SMs without splitting K), wide ones for prefill.
Checked on an H100 (`scripts/probe_invariant_tiles_gpu.py`): every tile and K step of 64, 128 and 256, at 1 to
4,096 rows, gave the same bits on Llama-3.1-8B's projections and LM head. Interpret mode (the CPU tests) adds the
16-wide slices one by one as the MMAs do, so it keeps the same promise. Rows past `m`, and ragged K and N edges, are
masked to zero, never computed into the real rows.

Triton rules (JAX-PALLAS.md §1.2): power-of-two tiles, ragged edges masked, no scratch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr
from jaxtyping import Array, Float

MMA_K = 16  # the K slice of one bf16/fp16 tensor-core MMA, the unit of a row's additions (tf32's 8 divides it)


@dataclasses.dataclass(frozen=True)
class Tile:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def stage_bytes(self, itemsize: int) -> int:
        return (self.block_m + self.block_n) * self.block_k * itemsize


TILE = Tile()  # wide weights' decode rows
WIDE = Tile(block_m=128, block_n=256, num_warps=8, num_stages=3)  # prefill rows
WIDE_MIN_COLUMNS = 16384  # the fused gate/up and LM heads: enough column tiles without narrowing them
# Narrow weights (q/k/v, o, down) by row count: (most rows, candidate tiles); above the last, WIDE. A call takes the
# candidate with the most programs (output tiles) that still fit one wave of the GPU's SMs, else the first: a second,
# part-filled wave costs as much as the first. Measured on an H100 on the 8B projections, µs per call in one run
# (`results/2026-12-06-invariant-tiles-e21ca20.json`): at 16 rows o (4,096 columns) 14.3 in 16 × 32 tiles (128
# programs) against 14.9 in 16 × 64 (64), q/k/v (6,144) 20.2 in 16 × 64 (96) against 23.3 in 16 × 32 (192); at 256
# rows q/k/v 36.0 in 128 × 128 (96) against 41.1 in 64 × 128 (192), o and down fastest in 64 × 128 (128 programs each:
# 22.1, 67.8). Every candidate kept every bit there. (At 64 rows down's 64 × 32 tiles gained 2 %, o's nothing: left
# out, as in interpret mode its float32 slices of 32 columns round apart from the others'.)
NARROW_TILES = ((16, (Tile(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4),
                      Tile(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=6))),
                (64, (Tile(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4),)),
                (256, (Tile(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4),
                       Tile(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4))),
                (2048, (Tile(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),)))
# (The 256-row tiles' fourth stage, 2d9a43c on an H100, µs per call: q/k/v 29.1 against 36.0 with three, o 18.4
# against 21.9, down 55.3 against 67.6; 64 × 128 × 128 then holds 192 KiB of stages.)
WIDE_MIN_ROWS = 128
# Pipelined stages' bytes a program may hold, by compute capability: a block's shared-memory limit (Hopper and
# datacenter Blackwell 227 KiB, A100 163 KiB, other parts 99 KiB or more) less room for the epilogue's own buffers
SHARED_MEMORY_LIMITS = {"9.0": 227 * 1024, "10.0": 227 * 1024, "8.0": 163 * 1024, "8.7": 163 * 1024}
SMALLEST_SHARED_MEMORY_LIMIT = 99 * 1024
EPILOGUE_RESERVE = 24 * 1024
DEFAULT_SM_COUNT = 132  # an H100's or H200's SMs, where the device does not say (the CPU's interpret mode)
DEFAULT_CAPABILITY = "9.0"  # likewise its compute capability


@functools.cache
def device_sm_count() -> int:
    """The default device's SM count (its `core_count` on a GPU), else `DEFAULT_SM_COUNT`."""
    return getattr(jax.devices()[0], "core_count", None) or DEFAULT_SM_COUNT


@functools.cache
def shared_memory_budget(capability: str | None = None) -> int:
    """Bytes of pipelined stages a program may hold on a device of `capability` (default: the default device's)."""
    capability = capability or getattr(jax.devices()[0], "compute_capability", None) or DEFAULT_CAPABILITY
    return SHARED_MEMORY_LIMITS.get(capability, SMALLEST_SHARED_MEMORY_LIMIT) - EPILOGUE_RESERVE


def tile_for(m: int, n: int, itemsize: int = 2, sm_count: int | None = None, capability: str | None = None) -> Tile:
    """The output tile and K step of an `[m, k] @ [k, n]` product; none changes a row's additions. Stages are cut
    to fit the device's `shared_memory_budget` (wider dtypes, smaller parts: stages change the prefetch, not the
    arithmetic). `sm_count`, `capability`: the device's wave and compute capability (default: the device's)."""
    if n >= WIDE_MIN_COLUMNS:
        tile = WIDE if m >= WIDE_MIN_ROWS else TILE
    else:
        candidates = next((tiles for rows, tiles in NARROW_TILES if m <= rows), (WIDE,))
        tile = _fullest_wave(candidates, m, n, sm_count or device_sm_count())
    stages = max(1, min(tile.num_stages, shared_memory_budget(capability) // tile.stage_bytes(itemsize)))
    return dataclasses.replace(tile, num_stages=stages)


def _fullest_wave(candidates: tuple[Tile, ...], m: int, n: int, sm_count: int) -> Tile:
    """The candidate with the most programs not over `sm_count`; the first where every one is over."""
    def programs(tile: Tile) -> int:
        return pl.cdiv(m, tile.block_m) * pl.cdiv(n, tile.block_n)

    fitting = [t for t in candidates if programs(t) <= sm_count]
    return max(fitting, key=programs) if fitting else candidates[0]


def _arange(start, size: int):
    return start + jnp.arange(size, dtype=jnp.int32)


def _step_product(x_ref, w_ref, rows, cols, i, acc, *, tile: Tile, transposed: bool, interpret: bool):
    """`acc` plus K step `i`'s product of this program's tile, in float32."""
    m_dim, k_dim = x_ref.shape
    n_dim = w_ref.shape[0] if transposed else w_ref.shape[1]
    ks = _arange(i * tile.block_k, tile.block_k)
    x = pltr.load(x_ref.at[rows[:, None], ks[None, :]], mask=(rows[:, None] < m_dim) & (ks[None, :] < k_dim),
                  other=0)
    if transposed:  # w [n, k]
        w = pltr.load(w_ref.at[cols[:, None], ks[None, :]],
                      mask=(cols[:, None] < n_dim) & (ks[None, :] < k_dim), other=0).T
    else:
        w = pltr.load(w_ref.at[ks[:, None], cols[None, :]],
                      mask=(ks[:, None] < k_dim) & (cols[None, :] < n_dim), other=0)
    w = w.astype(x.dtype)
    if not interpret:  # Triton folds `acc + dot` into the MMAs' accumulator: one slice of MMA_K at a time
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
    for s in range(0, tile.block_k, MMA_K):  # the same chain, spelled out for the interpreter
        acc = acc + jnp.dot(x[:, s:s + MMA_K], w[s:s + MMA_K], preferred_element_type=jnp.float32)
    return acc


def _kernel(x_ref, w_ref, y_ref, *, tile: Tile, transposed: bool, interpret: bool):
    rows = _arange(pl.program_id(0) * tile.block_m, tile.block_m)
    cols = _arange(pl.program_id(1) * tile.block_n, tile.block_n)
    step = functools.partial(_step_product, x_ref, w_ref, rows, cols, tile=tile, transposed=transposed,
                             interpret=interpret)
    total = lax.fori_loop(0, pl.cdiv(x_ref.shape[1], tile.block_k), step,
                          jnp.zeros((tile.block_m, tile.block_n), jnp.float32))
    pltr.store(y_ref.at[rows[:, None], cols[None, :]], total.astype(y_ref.dtype),
               mask=(rows[:, None] < y_ref.shape[0]) & (cols[None, :] < y_ref.shape[1]))


@functools.partial(jax.jit, static_argnames=("transposed", "out_dtype", "interpret", "tile"))
def invariant_matmul(
    x: Float[Array, "m k"], w: Float[Array, "k n"] | Float[Array, "n k"], *, transposed: bool = False,
    out_dtype=None, interpret: bool = False, tile: Tile | None = None,
) -> Float[Array, "m n"]:
    """`x @ w` (`transposed`: `x @ w.T` for w `[n, k]`, the LM head's layout), in `out_dtype` (x's by default).
    `tile`: the output tile, K step, warps and stages (default `tile_for` the shape); any gives the same bits."""
    (m, _), n = x.shape, w.shape[0] if transposed else w.shape[1]
    tile = tile or tile_for(m, n, jnp.dtype(w.dtype).itemsize)
    if tile.block_k % MMA_K:
        raise ValueError(f"tile.block_k={tile.block_k}: K steps are whole MMA slices of {MMA_K}")
    kernel = functools.partial(_kernel, tile=tile, transposed=transposed, interpret=interpret)
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(m, tile.block_m), pl.cdiv(n, tile.block_n)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype or x.dtype),
        in_specs=[pl.no_block_spec] * 2, out_specs=pl.no_block_spec, interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=tile.num_warps, num_stages=tile.num_stages),
        name="invariant_matmul")(x, w)
