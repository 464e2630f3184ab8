"""The NVIDIA GPU attention backend: the Pallas kernels of `pallas_kernels/` behind the `AttentionBackend` signature.

The write goes first (this step's K/V must be visible to its own queries), then one ragged paged attention call over
the whole flattened batch. Shapes the kernel does not handle (head_dim other than 64/128, page sizes outside
16..128) fall back to the reference path at trace time, with one log line, so a model never fails to run. A float8
cache (`kv_cache.QuantizedKV`) hands its per-(layer, KV head) scales to both kernels.

K/V write (`write_kv`): both paths are exact and in place and write the same bytes; `scripts/bench_kernels.py` times
them inside one jit writing 32 layers, unrolled as in the step, at 64 to 2048 tokens. Buckets of at least
`KV_WRITE_KERNEL_MIN_TOKENS` tokens use the kernel, one token a program below `KV_WRITE_WIDE_PROGRAM_TOKENS` (enough
programs to spread a small write over the SMs) and eight from there; smaller buckets use the scatter, which XLA may
fuse with the K/V producer. The choice depends on the static bucket only. A float8 cache the write kernel's 32-bit
offsets cannot address (`pallas_kernels/addressing.py`) takes the scatter at every size; the attention kernel reads
such a cache through its byte-pair view.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from pallas_kernels.addressing import offsets_overflow
from pallas_kernels.kv_write import write_kv as pallas_write_kv
from pallas_kernels.kv_write.reference import write_kv as scatter_write_kv
from pallas_kernels.ragged_paged_attention import UnsupportedShapeError, check_supported, ragged_paged_attention
from pallas_kernels.ragged_paged_attention.tuning import DECODE_SPLIT_TOKENS, FP8_DECODE_SPLIT_TOKENS

from jengine.attention import reference
from jengine.attention.kv_cache import QuantizedKV, partition_spec, parts
from jengine.errors import ConfigError

logger = logging.getLogger(__name__)

# Measured (32 layers unrolled, an H100, results/2026-12-07-kernels-13bb250.json, 2026-12-08-kernels-9a5661a.json): at
# 64 tokens the kernel took 103 / 109 µs at one token a program and 128 / 122 at eight, the scatter 146 / 112 µs; at
# 1024 tokens one a program took 306 / 107 µs against eight's 340 / 130, at 2048 224 / 207 against 243 / 204 (the
# scatter 1311 / 1296). Below 64 tokens (decode at small batches) the kernel is untimed, so the scatter stays there;
# beyond 2048 it is untimed too, and takes eight tokens a program as before.
KV_WRITE_KERNEL_MIN_TOKENS = 64
KV_WRITE_WIDE_PROGRAM_TOKENS = 4096
# MoE steps of at least this many tokens take the Mosaic GPU grouped matmuls on Hopper
# (`PallasExperts.mosaic_min_tokens`), on one device (untested under expert parallelism's shard_map). Measured on an
# H100 (results/2026-12-07-moe-mosaic-13bb250.json, Qwen3-30B-A3B's layer): one layer 1.03× the Triton kernels' speed
# at 4096 tokens, 0.92× at 1024, 0.89× at 256; a 4096-token prompt through 24 layers 43.5 against 46.4 ms.
MOSAIC_EXPERTS_MIN_TOKENS = 4096


def supports(*, head_dim: int, block_size: int, num_q_heads: int, num_kv_heads: int, dtype,
             interpret: bool = False) -> bool:
    """Whether the kernels handle these shapes and dtypes (logged when not, with the reason). Refused on the GPU,
    where interpret mode runs it exactly: float32 (the tiles are sized for 16-bit data; a float32 Llama-8B step
    failed on the H200, benchmarks/results/2026-11-29-multigpu.json). Caches of every size and dtype are
    addressable (a float8 one through its byte-pair view, `pallas_kernels/addressing.py`)."""
    try:
        check_supported(head_dim=head_dim, block_size=block_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
        if jnp.dtype(dtype) == jnp.float32 and not interpret:
            raise UnsupportedShapeError("the kernels run 16-bit models on the GPU, not float32")
    except UnsupportedShapeError as e:
        logger.warning("pallas_gpu attention cannot run this model (%s); using the reference path", e)
        return False
    return True


@dataclasses.dataclass(frozen=True)
class PallasGpuBackend:
    """Pallas K/V write (large buckets) or XLA scatter, then the ragged paged attention kernel. Hashable: the
    jitted step takes it as a static argument."""

    name: str = "pallas_gpu"
    interpret: bool = False  # CPU tests run the same kernels in Pallas interpret mode
    # Tensor parallelism: a kernel is per-device code, so on a multi-device mesh it runs under `shard_map`, each
    # device on its own query heads and the KV heads they use (the cache is split by KV head).
    mesh: Mesh | None = None
    # Batch-invariant mode (`--deterministic`): a row's attention adds up the same way in either kernel
    # (`single_path`); `invariant_segment`: its long contexts cut into segments of that many positions
    # (`Tuning.invariant_segment`; None: one split), `invariant_split` of them a decode program
    # (`Tuning.invariant_split`; None: one segment); `parallel_short_segments`: a short step's segments on programs
    # of their own (`Tuning.parallel_short_segments`)
    invariant: bool = False
    invariant_segment: int | None = None
    invariant_split: int | None = None
    parallel_short_segments: bool = False

    @property
    def experts(self):
        """The MoE experts on this platform: the grouped-matmul kernels (`jengine.layers.mlp.PallasExperts`)."""
        from jengine.layers.mlp import PallasExperts
        from pallas_kernels.ragged_paged_attention.mosaic_prefill import on_hopper

        one_device = self.mesh is None or self.mesh.size == 1
        mosaic = MOSAIC_EXPERTS_MIN_TOKENS if one_device and not self.interpret and on_hopper() else 0
        return PallasExperts(interpret=self.interpret, mesh=self.mesh, mosaic_min_tokens=mosaic)

    def one_split_positions(self, quantized: bool) -> int | None:
        """`merge_free`'s width: the positions one deterministic decode program walks (None: it never splits),
        else the fast decode's split. A decode step given a table this narrow launches one attention kernel a
        layer, where a wider one adds the merge (as the engine's pinned full-width tables did at every context
        length)."""
        if self.invariant:
            return self.invariant_split or self.invariant_segment
        return FP8_DECODE_SPLIT_TOKENS if quantized else DECODE_SPLIT_TOKENS

    def __call__(self, q, k, v, kv_cache, layer, md, *, scale, sliding_window, soft_cap):
        call = functools.partial(self._local, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
        if self.mesh is None or self.mesh.size == 1:
            return call(q, k, v, kv_cache, layer, md)
        axis = self.mesh.axis_names[0]
        heads, cache = P(None, axis, None), partition_spec(kv_cache, axis)
        sharded = jax.shard_map(call, mesh=self.mesh, in_specs=(heads, heads, heads, cache, P(), P()),
                                out_specs=(heads, cache), check_vma=False)
        return sharded(q, k, v, kv_cache, layer, md)

    def _local(self, q, k, v, kv_cache, layer, md, *, scale, sliding_window, soft_cap):
        _, _, block_size, _, kv_heads, head_dim = kv_cache.shape
        if not supports(head_dim=head_dim, block_size=block_size, num_q_heads=q.shape[1], num_kv_heads=kv_heads,
                        dtype=q.dtype, interpret=self.interpret):
            if self.invariant:  # the reference's reductions follow the batch on a GPU: the promise would not hold
                raise ConfigError("deterministic=True needs the pallas_gpu attention kernels, which cannot run this "
                                  "model (logged above)")
            return _reference(q, k, v, kv_cache, layer, md, scale=scale, sliding_window=sliding_window,
                              soft_cap=soft_cap)
        kv_cache = write_kv(kv_cache, layer, md.slot_mapping, k, v, interpret=self.interpret)
        kv, kv_scales = parts(kv_cache)
        out = ragged_paged_attention(
            q, kv, layer, md.query_start_loc, md.seq_lens, md.block_tables, kv_scales=kv_scales, scale=float(scale),
            sliding_window=sliding_window, soft_cap=float(soft_cap) if soft_cap else None,
            max_query_len=md.max_query_len, interpret=self.interpret, single_path=self.invariant,
            invariant_segment=self.invariant_segment if self.invariant else None,
            invariant_split=self.invariant_split if self.invariant else None,
            parallel_short_segments=self.invariant and self.parallel_short_segments,
        )
        return out, kv_cache



def write_kv(kv_cache, layer, slot_mapping, k, v, *, interpret: bool = False):
    """This step's K/V into the cache by the faster path for the static token count (module docstring). The scatter
    is the one `scripts/bench_kernels.py` times (jengine's reference write measured 4-16 % slower than it)."""
    kv, kv_scales = parts(kv_cache)
    if k.shape[0] < KV_WRITE_KERNEL_MIN_TOKENS or (offsets_overflow(kv.shape, kv.dtype) and not interpret):
        kv = scatter_write_kv(kv, layer, slot_mapping, k, v, kv_scales=kv_scales)
    else:
        per_program = 1 if k.shape[0] < KV_WRITE_WIDE_PROGRAM_TOKENS else 8
        kv = pallas_write_kv(kv, layer, slot_mapping, k, v, kv_scales=kv_scales, interpret=interpret,
                             tokens_per_program=per_program)
    return kv if kv_scales is None else QuantizedKV(kv, kv_scales)


def _reference(q, k, v, kv_cache, layer, md, *, scale, sliding_window, soft_cap):
    kv_cache = reference.write_kv(kv_cache, layer, md.slot_mapping, k, v)
    out = reference.paged_attention(q, kv_cache, layer, md, scale=scale, sliding_window=sliding_window,
                                    soft_cap=soft_cap)
    return out, kv_cache
