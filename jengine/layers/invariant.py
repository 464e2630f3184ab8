"""Batch-invariant projections (`--deterministic`): a weight whose matmul reduces each row in an order fixed by the
row alone, so a request's logits do not depend on the batch, the chunking or the bucket it runs in.

An `InvariantWeight` wraps a float weight the way `QuantizedWeight` wraps an 8-bit one: `layers/linear.py` and the
LM head (`models/decoder.py:compute_logits`) dispatch on it. On NVIDIA GPUs it runs `pallas_kernels/invariant_matmul`
(K never split: one accumulator per output walks K in order, whatever tile the row count picks); on the CPU, where
XLA's dot already reduces a row the same way whatever the row count (the engine's CPU tests hold it), the plain dot.

Row reductions go the same way: the norms' weights are wrapped as `InvariantNorm` (`layers/norm.py` dispatches on
it; the residual add before a norm runs in the norm's kernel), and the log-softmax of the logprobs and the MoE
router's softmax use `invariant_log_softmax`, each on `pallas_kernels/invariant_matmul/rows.py` on NVIDIA GPUs
(XLA's reduction emitter lays a row out by the whole shape: on the H200 a 128k-vocabulary log-softmax at 16 rows
rounded differently from the same rows among 64).

Under tensor parallelism a wrapped weight carries its mesh and PartitionSpec and multiplies per device under
`shard_map` (a Pallas call must not be handed to XLA's partitioner, which would gather the whole weight); a weight
split along its inputs (the row-parallel o and down projections) leaves partial sums that
`parallel/collectives.py:ordered_psum` adds in device order instead of an all-reduce. The row kernels run once per
device on whole inputs, under `shard_map` as well.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float

from jengine.parallel.collectives import ordered_psum

InvariantImpl = Literal["xla", "pallas", "pallas_interpret"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InvariantWeight:
    """A float weight `[in, out]` (`transposed`: `[out, in]`, the embedding-shaped LM head); under tensor
    parallelism, `mesh` and the weight's `spec` on it (`parallel/sharding.py`)."""

    w: Float[Array, "a b"]
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))
    impl: InvariantImpl = dataclasses.field(default="xla", metadata=dict(static=True))
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))
    spec: P = dataclasses.field(default=P(), metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape[::-1] if self.transposed else self.w.shape

    @property
    def dtype(self):
        return self.w.dtype

    @property
    def nbytes(self) -> int:
        return self.w.nbytes


def invariant_matmul(x: Float[Array, "tokens k"], w: InvariantWeight, precision=None,
                     out_dtype=None) -> Float[Array, "tokens n"]:
    """x @ w in `out_dtype` (x's by default), each row's reduction fixed by the implementation's one tiling."""
    out_dtype = out_dtype or x.dtype
    if w.mesh is None or w.mesh.size == 1:
        return _local_matmul(x, w.w, w, precision, out_dtype)
    return _sharded_matmul(x, w, precision, out_dtype)


def _local_matmul(x, weight, w: InvariantWeight, precision, out_dtype):
    if w.impl == "xla":
        dims = (((1,), (1 if w.transposed else 0,)), ((), ()))
        return jax.lax.dot_general(x, weight, dims, precision=precision,
                                   preferred_element_type=jnp.float32).astype(out_dtype)
    from pallas_kernels.invariant_matmul import invariant_matmul as kernel  # Pallas imported only where used

    return kernel(x, weight, transposed=w.transposed, out_dtype=out_dtype, interpret=w.impl == "pallas_interpret")


def _sharded_matmul(x, w: InvariantWeight, precision, out_dtype):
    """Each device multiplies its slices; split inputs (row-parallel) leave float32 partials added in device
    order. The output is split as the weight's outputs are (column-parallel, the vocab-parallel LM head)."""
    spec = tuple(w.spec) + (None,) * (2 - len(w.spec))
    k_axis, n_axis = (spec[1], spec[0]) if w.transposed else spec

    def local(x, weight):
        if k_axis is None:
            return _local_matmul(x, weight, w, precision, out_dtype)
        return ordered_psum(_local_matmul(x, weight, w, precision, jnp.float32), k_axis).astype(out_dtype)

    return jax.shard_map(local, mesh=w.mesh, in_specs=(P(None, k_axis), P(*spec)), out_specs=P(None, n_axis),
                         check_vma=False)(x, w.w)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InvariantNorm:
    """An RMSNorm weight `[d]` whose statistics are reduced per row in a fixed order (`mesh`: the model's, under
    tensor parallelism)."""

    w: Float[Array, " d"]
    impl: InvariantImpl = dataclasses.field(default="xla", metadata=dict(static=True))
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class RowReduction:
    """How a row reduction (the logprobs' log-softmax, the router's softmax) runs: `impl`, and under tensor
    parallelism the model's `mesh`. Hashable: a static field of the sampling metadata."""

    impl: InvariantImpl = "xla"
    mesh: Mesh | None = None


def on_every_device(fn, mesh: Mesh | None, *args):
    """`fn` on whole (replicated) inputs, once per device of `mesh`: a Pallas kernel is per-device code, never
    handed to XLA's partitioner (the inputs are gathered first where they are split, as the vocabulary's logits)."""
    if mesh is None or mesh.size == 1:
        return fn(*args)
    return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(*args)


def invariant_rms_norm(x: Float[Array, "... d"], weight: InvariantNorm, eps: float) -> Float[Array, "... d"]:
    from pallas_kernels.invariant_matmul.rows import rms_norm_rows  # Pallas imported only where used

    interpret = weight.impl == "pallas_interpret"
    return on_every_device(lambda x, w: rms_norm_rows(x, w, eps=eps, interpret=interpret), weight.mesh, x, weight.w)


def invariant_add_rms_norm(x: Float[Array, "... d"], delta: Float[Array, "... d"], weight: InvariantNorm,
                           eps: float) -> tuple[Float[Array, "... d"], Float[Array, "... d"]]:
    """(x + delta, its RMSNorm) in one row kernel, each bitwise the unfused add and `invariant_rms_norm`."""
    from pallas_kernels.invariant_matmul.rows import add_rms_norm_rows

    interpret = weight.impl == "pallas_interpret"
    return on_every_device(lambda x, d, w: add_rms_norm_rows(x, d, w, eps=eps, interpret=interpret), weight.mesh,
                           x, delta, weight.w)


def invariant_rms_norm_pair(a: Float[Array, "... d"], b: Float[Array, "... d"], weight_a: InvariantNorm,
                            weight_b: InvariantNorm, eps: float) -> tuple[Float[Array, "... d"], Float[Array, "... d"]]:
    """Two RMSNorms of the same row width in one row kernel, each bitwise `invariant_rms_norm`."""
    from pallas_kernels.invariant_matmul.rows import rms_norm_pair_rows

    interpret = weight_a.impl == "pallas_interpret"
    return on_every_device(lambda a, b, wa, wb: rms_norm_pair_rows(a, b, wa, wb, eps=eps, interpret=interpret),
                           weight_a.mesh, a, b, weight_a.w, weight_b.w)


def invariant_log_softmax(x: Float[Array, "n v"], how: RowReduction) -> Float[Array, "n v"]:
    """Row-wise log-softmax in float32 (`how.impl` "xla": XLA's own)."""
    if how.impl == "xla":
        return jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)
    from pallas_kernels.invariant_matmul.rows import log_softmax_rows

    interpret = how.impl == "pallas_interpret"
    return on_every_device(lambda x: log_softmax_rows(x, interpret=interpret), how.mesh, x)


def ordered_sum(x: Float[Array, "n k"]) -> Float[Array, " n"]:
    """Each row's sum over a short last axis, added left to right: the order never depends on the shape."""
    total = x[:, 0]
    for j in range(1, x.shape[1]):
        total = total + x[:, j]
    return total


def row_reduction_for(params: dict) -> RowReduction:
    """How the model's row reductions run: as its LM head's matmul when that is batch-invariant, else XLA's."""
    head = params.get("lm_head")
    return RowReduction(head.impl, head.mesh) if isinstance(head, InvariantWeight) else RowReduction()


def invariant_impl(platform: str) -> InvariantImpl:
    return "pallas" if platform == "gpu" else "xla"


def make_invariant(params: dict, impl: InvariantImpl, tied: bool, layout=None) -> dict:
    """The model's float projections and LM head wrapped (the arrays themselves untouched). A tied model's LM head
    is the embedding table: `lm_head` then holds the same array, the embedding lookup still reads `embed`.
    `layout` (a `parallel/sharding.py:ParallelLayout`): where the weights are split, under tensor parallelism."""
    projections = ("wqkv", "wo", "w_gate_up", "w_down", "ws_gate_up", "ws_down", "router")

    def placement(name: str) -> dict:
        if layout is None or layout.size == 1:
            return {}
        return dict(mesh=layout.mesh, spec=layout.param_spec(f"['{name}']", 2))

    def wrap(name: str, leaf):
        if not (isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating)):
            return leaf
        if name in projections and leaf.ndim == 2:
            return InvariantWeight(leaf, False, impl, **placement(name))
        if name.endswith("_norm") and leaf.ndim == 1:
            return InvariantNorm(leaf, impl, placement(name).get("mesh"))
        return leaf

    layers = tuple({name: wrap(name, leaf) for name, leaf in layer.items()} for layer in params["layers"])
    head = params["embed"] if tied else params["lm_head"]
    return {**params, "layers": layers, "final_norm": wrap("final_norm", params["final_norm"]),
            "lm_head": InvariantWeight(head, True, impl, **placement("lm_head"))}
