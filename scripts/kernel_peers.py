"""The peers `bench_kernels.py` times our attention kernels against, each built from the same K/V as ours:

* torch `scaled_dot_product_attention` (flash and cuDNN backends, `enable_gqa=True`) and
  `jax.nn.dot_product_attention(implementation="cudnn")`, decode (one query token per sequence) over a contiguous
  bf16 cache gathered from our paged one (`[batch, kv_heads, context, head_dim]` for torch, `[batch, context,
  kv_heads, head_dim]` for JAX); torch reads JAX's buffers through DLPack, so all peers see the same numbers;
* JAX's bundled Mosaic GPU `attention_mgpu` (FA3-style, float16 only in this JAX), a causal prefill over contiguous
  K/V.

Each builder returns `(fn, args, timer)`: `timer(fn, *args, runs=...)` times back-to-back calls with one
synchronisation per run (`block_until_ready` for JAX, `torch.cuda.synchronize` for torch), the same method for both.
Builders raise when a peer cannot run here (no GPU, a backend that refuses the shape); the caller records that.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp

import gpu_bench_common as common


def timeit_torch(fn, *args, runs: int = 5, target_s: float = 0.05, min_calls: int = 5, max_calls: int = 400) -> float:
    """`gpu_bench_common.timeit` with `torch.cuda.synchronize` as the one sync per run."""
    import torch

    sync = torch.cuda.synchronize
    fn(*args)
    sync()
    t0 = time.perf_counter()
    fn(*args)
    sync()
    n = int(min(max(target_s / max(time.perf_counter() - t0, 1e-6), min_calls), max_calls))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*args)
        sync()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


@functools.partial(jax.jit, static_argnames=("context",))
def contiguous_kv(kv, layer, block_tables, *, context: int):
    """K and V of one layer gathered from the paged cache: two `[batch, context, kv_heads, head_dim]` arrays."""
    _, _, block_size, _, kv_heads, head_dim = kv.shape
    pages = kv[layer][block_tables].reshape(block_tables.shape[0], -1, 2, kv_heads, head_dim)[:, :context]
    return pages[:, :, 0], pages[:, :, 1]


def torch_sdpa_decode(q, k, v, backend: str, scale: float):
    """q `[batch, q_heads, head_dim]`, k/v `[batch, context, kv_heads, head_dim]` (JAX) → a torch SDPA decode."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    tq = to_torch(q[:, :, None, :])  # [batch, q_heads, 1, head_dim]
    tk, tv = (to_torch(jnp.transpose(x, (0, 2, 1, 3))) for x in (k, v))  # [batch, kv_heads, ctx, head_dim]

    def call(q, k, v):
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    return call, (tq, tk, tv), timeit_torch


def to_torch(x: jax.Array):
    """The same buffer through DLPack; through the host (float32, then bf16 on the device) if DLPack refuses."""
    import numpy as np
    import torch

    try:
        return torch.from_dlpack(x)
    except Exception as e:  # noqa: BLE001 - any refusal: the copy below gives the same numbers, only slower
        common.log(f"  DLPack refused ({type(e).__name__}: {e}); copying through the host")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(device=device, dtype=torch.bfloat16)


def torch_output(out) -> jax.Array:
    """A torch decode output `[batch, q_heads, 1, head_dim]` as a JAX `[batch, q_heads, head_dim]` array."""
    return jnp.asarray(out.float().cpu().numpy())[:, :, 0]


def jax_cudnn_decode(q, k, v, scale: float):
    """`jax.nn.dot_product_attention` with cuDNN: q `[batch, 1, q_heads, d]` over k/v `[batch, ctx, kv_heads, d]`."""
    fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn")[:, 0])
    return fn, (q[:, None], k, v), common.timeit


def mgpu_prefill(seq: int, q_heads: int, kv_heads: int, head_dim: int, causal: bool = True):
    """The bundled FA3-style Mosaic GPU attention, float16, one sequence of `seq` tokens (it applies no softmax
    scale; the FLOPs are the same); also returns an XLA float32 reference of the same inputs for the check."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (1, seq, q_heads, head_dim), jnp.float32).astype(jnp.float16)
    k, v = (jax.random.normal(key, (1, seq, kv_heads, head_dim), jnp.float32).astype(jnp.float16) for key in keys[1:])
    cfg = mgpu.TuningConfig(block_q=128, block_kv=128, max_concurrent_steps=2, causal=causal)
    fn = jax.jit(functools.partial(mgpu.attention, config=cfg))

    def reference():
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return jax.nn.dot_product_attention(*f32, scale=1.0, is_causal=causal, implementation="xla")  # unscaled

    return (fn, (q, k, v), common.timeit), reference
