"""4-bit weight-only projections (W4A16: AWQ, GPTQ, compressed-tensors `pack-quantized`), kept packed on the device.

An `Int4Weight` is the pytree `layers/linear.py:linear` dispatches on beside the 8-bit `QuantizedWeight`. It holds
the layout `pallas_kernels/w4a16` reads: `packed [K / 8, N]` int32, input rows 8r … 8r + 7 of column c in word
(r, c), row 8r + j at bits 4j; `zeros` and `scales` `[K / group, N]` (w = (q − zero) · scale of the row's group).
GPTQ's activation order is applied once at load: the rows are stored sorted by group, and `perm` (the stored row
order) gathers the activations' features to match, so each group is contiguous for the kernel.

Implementations, chosen at load (`impl`): `reference` (the CPU: unpack, dequantize, one matmul), `pallas` (NVIDIA
GPUs: the Triton kernels, a CUDA-core split-K kernel for decode rows, tensor-core tiles for more rows, dequantize +
cuBLAS for prefill chunks; `pallas_kernels/w4a16/config.py`) and `pallas_interpret` (the kernels in interpret mode,
for CPU tests). `configs` overrides the kernel configuration by row count (benchmarks pass their sweep's best).

`mosaic` (Hopper GPUs; `mosaic_interpret` in CPU tests) keeps another layout, the one `pallas_kernels/weight_only`
streams through TMA: `packed [N, K]` jnp.int4 holding the signed nibbles q − 8 (output feature n's inputs
contiguous), `zeros` in the same signed units (z − 8), `scales` as above; up to `MOSAIC_MAX_ROWS` rows run that
kernel (the weight upcast in registers, wgmma with the weight as the 64-row operand), more rows dequantize in one
XLA fusion and multiply by cuBLAS. `to_mosaic` converts a placed `pallas` weight on its devices.

Tensor parallelism: a kernel is per-device code, so a weight split over a mesh (`split`, set by the loader from
where it placed the leaves) runs it under `shard_map`: column-parallel projections (q/k/v, gate/up) on each device's
output columns, row-parallel ones (o, down) on each device's whole groups of input rows, their partial products
summed over the mesh, as the float path's all-reduce.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int

PACK = 8  # 4-bit values per int32 word
Impl4 = Literal["reference", "pallas", "pallas_interpret", "mosaic", "mosaic_interpret"]
MOSAIC_MAX_ROWS = 64  # rows the Mosaic weight-only kernel takes; beyond, dequantize + cuBLAS
NIBBLE_MIDDLE = 8  # unsigned nibble u is the signed int4 u − 8
KernelConfigs = tuple[tuple[int, object], ...]  # ((up to this many rows, W4A16Config), …), ascending


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """A 4-bit projection of logical shape `[K, N]` (our `[in, out]`)."""

    packed: Int[Array, "k8 n"]
    zeros: Float[Array, "g n"]
    scales: Float[Array, "g n"]
    perm: Int[Array, " k"] | None  # stored row i is input feature perm[i]; None: natural order
    group: int = dataclasses.field(default=128, metadata=dict(static=True))
    impl: Impl4 = dataclasses.field(default="reference", metadata=dict(static=True))
    configs: KernelConfigs | None = dataclasses.field(default=None, metadata=dict(static=True))
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))
    split: Literal["columns", "rows"] | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def nk(self) -> bool:
        """Whether `packed` is the Mosaic kernel's `[N, K]` int4 layout (see the module docstring)."""
        return self.impl.startswith("mosaic")

    @property
    def shape(self) -> tuple[int, int]:
        if self.nk:
            return (self.packed.shape[1], self.packed.shape[0])
        return (self.packed.shape[0] * PACK, self.packed.shape[1])

    @property
    def nbytes(self) -> int:
        extra = 0 if self.perm is None else self.perm.nbytes
        return stored_bytes(self.packed) + self.zeros.nbytes + self.scales.nbytes + extra


def stored_bytes(array) -> int:
    """An array's bytes as stored: int4 two to a byte (jax's `nbytes` counts a byte per int4 value)."""
    bits = 4 if array.dtype == jnp.int4 else array.dtype.itemsize * 8
    return array.size * bits // 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Experts:
    """A MoE layer's stack of 4-bit expert projections, logical shape `[experts, K, N]`: each expert in the layout of
    `Int4Weight` (`packed [experts, K / 8, N]`, `zeros` and `scales` `[experts, K / group, N]`), the input rows
    sorted by group (`perm` below). The grouped-matmul kernels read them
    packed (`layers/mlp.py:PallasExperts`); `ragged_dot` (the CPU) takes them dequantized. The group is read from
    the shapes, so a stack split over devices (by expert, or by whole groups) stays consistent.

    GPTQ's activation order (`desc_act`) orders each expert's rows its own way. The loader sorts every stack's rows
    by group: gate's and up's `perm[e, k]` is the input feature of stored row k (the kernels gather x's features by
    it); the down projection's order is folded into gate's and up's output columns (stored in down's row order,
    so the hidden features arrive as down's rows expect them), and its `perm` is None."""

    packed: Int[Array, "e k8 n"]
    zeros: Float[Array, "e g n"]
    scales: Float[Array, "e g n"]
    perm: Int[Array, "e k"] | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, k8, n = self.packed.shape
        return (experts, k8 * PACK, n)

    @property
    def group(self) -> int:
        return self.shape[1] // self.zeros.shape[1]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.perm is None else self.perm.nbytes
        return self.packed.nbytes + self.zeros.nbytes + self.scales.nbytes + extra


def fits_kernel(n: int) -> bool:
    """Whether the kernels tile `n` output features (power-of-two column strips of at least 16)."""
    return n % 16 == 0


def fits_mosaic(k: int, n: int, group: int, shards: int = 1, split: str | None = None) -> bool:
    """Whether each device's share of a `[k, n]` weight fits the Mosaic kernel's tiles (64 output features, groups
    of whole 128-input steps: `weight_only.kernel.fits`)."""
    from pallas_kernels.weight_only.kernel import fits

    return fits(k // shards if split == "rows" else k, n // shards if split == "columns" else n, group)


def to_mosaic(w: Int4Weight, interpret: bool = False) -> Int4Weight:
    """A placed `pallas`-layout weight in the Mosaic kernel's layout, converted where it lies (each device its
    part); the words are freed once the caller drops `w`."""
    spec = _packed_spec(w.mesh.axis_names[0] if w.mesh is not None else None, w.split, nk=True)
    convert = jax.jit(_words_to_nk, out_shardings=NamedSharding(w.mesh, spec) if w.mesh is not None else None)
    return dataclasses.replace(w, packed=convert(w.packed), zeros=(w.zeros.astype(jnp.float32) - NIBBLE_MIDDLE).astype(
        w.zeros.dtype), impl="mosaic_interpret" if interpret else "mosaic")


def _words_to_nk(packed: Int[Array, "k8 n"]) -> Array:
    from pallas_kernels.w4a16 import unpack

    return (unpack(packed) - NIBBLE_MIDDLE).astype(jnp.int8).T.astype(jnp.int4)


def _packed_spec(axis, split, *, nk: bool) -> P:
    """Where a split weight's `packed` lies: the words `[K / 8, N]`, or the Mosaic layout `[N, K]`."""
    if split == "columns":
        return P(axis, None) if nk else P(None, axis)
    if split == "rows":
        return P(None, axis) if nk else P(axis, None)
    return P()


def kernel_config(w: Int4Weight, rows: int):
    """The first of the weight's `configs` covering `rows`, else its kernel's default for `rows` (the Mosaic
    kernel's: None, which it reads as its own default)."""
    from pallas_kernels.w4a16 import default_config

    chosen = next((cfg for limit, cfg in w.configs or () if rows <= limit), None)
    return chosen or (None if w.nk else default_config(rows))


def int4_matmul(x: Float[Array, "tokens k"], w: Int4Weight) -> Float[Array, "tokens n"]:
    """x @ ((q − zeros) · scales) in x's dtype, by the weight's implementation (per device where it is split)."""
    if w.perm is not None:
        x = jnp.take(x, w.perm, axis=-1)
    if w.split is None or w.mesh is None or w.mesh.size == 1:
        return _local_matmul(x, w.packed, w.zeros, w.scales, w=w)
    axis = w.mesh.axis_names[0]
    packed = _packed_spec(axis, w.split, nk=w.nk)
    if w.split == "columns":
        cols = P(None, axis)
        return jax.shard_map(lambda *a: _local_matmul(*a, w=w), mesh=w.mesh, in_specs=(P(), packed, cols, cols),
                             out_specs=cols, check_vma=False)(x, w.packed, w.zeros, w.scales)
    rows = P(axis, None)
    return jax.shard_map(lambda *a: jax.lax.psum(_local_matmul(*a, w=w), axis), mesh=w.mesh,
                         in_specs=(P(None, axis), packed, rows, rows), out_specs=P(), check_vma=False)(
        x, w.packed, w.zeros, w.scales)


def _local_matmul(x, packed, zeros, scales, *, w: Int4Weight):
    """One device's product (its x columns are the stored rows it holds: `perm` is applied before)."""
    from pallas_kernels.w4a16 import w4a16_matmul, w4a16_matmul_reference  # Pallas imported only where used

    if w.nk:
        return _mosaic_matmul(x, packed, zeros, scales, interpret=w.impl == "mosaic_interpret",
                              config=kernel_config(w, x.shape[0]))
    if w.impl == "reference":
        return w4a16_matmul_reference(x, packed, zeros, scales, group=w.group)
    return w4a16_matmul(x, packed, zeros, scales, group=w.group, config=kernel_config(w, x.shape[0]),
                        interpret=w.impl == "pallas_interpret")


def _mosaic_matmul(x, q, zeros, scales, *, interpret: bool, config=None):
    """Decode-sized bfloat16 rows through the Mosaic kernel (its wgmma multiplies bfloat16); more rows, or another
    dtype, through a dequantized weight and cuBLAS."""
    if x.shape[0] > MOSAIC_MAX_ROWS or x.dtype != jnp.bfloat16:
        w = _dequantized_nk(q, zeros, scales, x.dtype)
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(x.dtype)
    from pallas_kernels.weight_only.kernel import fitted_matmul  # Pallas imported only where used

    return fitted_matmul(x, q, scales, zeros, config=config, interpret=interpret)


def _dequantized_nk(q: Array, zeros: Float[Array, "g n"], scales: Float[Array, "g n"], dtype) -> Float[Array, "n k"]:
    """`(q − zeros) · scales` of the Mosaic layout, `[N, K]` (stored input order)."""
    n, k = q.shape
    groups = scales.shape[0]
    grouped = q.astype(jnp.float32).reshape(n, groups, k // groups) - zeros.astype(jnp.float32).T[:, :, None]
    return (grouped * scales.astype(jnp.float32).T[:, :, None]).reshape(n, k).astype(dtype)


def dequantize4(w: Int4Weight | Int4Experts, dtype=jnp.float32) -> Float[Array, "... k n"]:
    """The real `[K, N]` weight (`[experts, K, N]` for a stack), input features in their natural order."""
    from pallas_kernels.w4a16 import unpack

    if isinstance(w, Int4Experts):
        q = jax.vmap(unpack)(w.packed).astype(jnp.float32)
        rows = jnp.arange(q.shape[1]) // w.group
        stored = (q - w.zeros[:, rows].astype(jnp.float32)) * w.scales[:, rows].astype(jnp.float32)
        if w.perm is not None:  # stored row k is feature perm[e, k]: back to the features' order
            stored = jnp.take_along_axis(stored, jnp.argsort(w.perm, axis=1)[:, :, None], axis=1)
        return stored.astype(dtype)
    if w.nk:
        stored = _dequantized_nk(w.packed, w.zeros, w.scales, jnp.float32).T
        return (stored if w.perm is None else stored[jnp.argsort(w.perm)]).astype(dtype)
    q = unpack(w.packed).astype(jnp.float32)
    rows = jnp.arange(q.shape[0]) // w.group
    stored = (q - w.zeros[rows].astype(jnp.float32)) * w.scales[rows].astype(jnp.float32)
    return (stored if w.perm is None else stored[jnp.argsort(w.perm)]).astype(dtype)
