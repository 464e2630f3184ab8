"""x `[m, k]` times a 4-bit weight `[k, n]` with per-group zero points and scales (AWQ/GPTQ/compressed-tensors W4A16
after `jengine/models/quant4.py`'s unpacking, the activation-order permutation applied to the rows once at load).

The weight travels at 4 bits: `packed [k / 8, n]` int32 holds input rows 8r … 8r + 7 of column c in word (r, c),
row 8r + j at bits 4j; it is dequantized in registers, never in memory, by one of two Triton kernels
(`config.py` picks by row count): `gemv.py` for decode-sized m (CUDA-core multiply-adds, K split across programs
so that a few wide column strips still fill the GPU) and `tiled.py` for more rows (tensor cores). Prefill-sized m
takes the `dequant` path: dequantize in one XLA fusion, then cuBLAS.

Triton rules (JAX-PALLAS.md §1.2): power-of-two tiles; k a multiple of 128 and of the group (16, 32 or 64 rows,
or a multiple of 128), n of 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.w4a16.config import W4A16Config, column_block, default_config, k_splits, pow2_at_least
from pallas_kernels.w4a16.gemv import STEP_ROWS, gemv_call
from pallas_kernels.w4a16.nibbles import PACK
from pallas_kernels.w4a16.reference import dequantized_matmul
from pallas_kernels.w4a16.tiled import dot_call

__all__ = ["PACK", "w4a16_matmul"]


GEMV_ROW_LIMIT = 8  # the gemv kernel unrolls its rows, one accumulator tile each


def _check(m: int, k: int, n: int, k8: int, group: int, cfg: W4A16Config) -> None:
    group_fits = group % 16 == 0 and (STEP_ROWS % group == 0 or group % STEP_ROWS == 0)
    if k % group or k % STEP_ROWS or not group_fits or k8 * PACK != k or n % 16:
        raise ValueError(f"w4a16_matmul needs k ({k}) a multiple of 128 and of the group ({group}: 16, 32 or 64 "
                         f"rows, or a multiple of 128), n ({n}) of 16 and packed rows = k / 8 (got {k8})")
    if cfg.method == "gemv" and m > GEMV_ROW_LIMIT:
        raise ValueError(f"the gemv kernel takes at most {GEMV_ROW_LIMIT} rows (got {m}): use the dot method")
    if cfg.method == "dot" and (k % cfg.block_k or cfg.block_k % 16 or (group % cfg.block_k and cfg.block_k % group)):
        raise ValueError(f"block_k {cfg.block_k} must divide k ({k}) and divide or be a multiple of the group")


@functools.partial(jax.jit, static_argnames=("group", "config", "interpret"))
def w4a16_matmul(
    x: Float[Array, "m k"], packed: Int[Array, "k8 n"], zeros: Float[Array, "g n"], scales: Float[Array, "g n"],
    *, group: int = 128, config: W4A16Config | None = None, interpret: bool = False,
) -> Float[Array, "m n"]:
    """`x @ ((q − zeros[g]) · scales[g])` in x's dtype; `config` None: `default_config(m)`."""
    m, k = x.shape
    n = packed.shape[1]
    cfg = config or default_config(m)
    _check(m, k, n, packed.shape[0], group, cfg)
    if cfg.method == "dequant":
        return dequantized_matmul(x, packed, zeros, scales, group=group)
    block_n = column_block(n, cfg.block_n)
    if cfg.method == "gemv":
        split = k_splits(k // STEP_ROWS, n // block_n, cfg.min_programs)
        out = gemv_call(x, packed, zeros, scales, group=group, block_n=block_n, split=split,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, prefetch=cfg.prefetch,
                        interpret=interpret)
    else:
        block_m = min(cfg.block_m, pow2_at_least(m))
        split = k_splits(k // cfg.block_k, -(-m // block_m) * (n // block_n), cfg.min_programs)
        out = dot_call(x, packed, zeros, scales, group=group, block_m=block_m, block_n=block_n,
                       block_k=cfg.block_k, split=split, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                       planes=cfg.planes, interpret=interpret)
    return out[0] if split == 1 else jnp.sum(out, axis=0).astype(x.dtype)
