"""Batch-invariant projections (`--deterministic`): a weight whose matmul reduces each row in an order fixed by the
row alone, so a request's logits do not depend on the batch, the chunking or the bucket it runs in.

An `InvariantWeight` wraps a float weight the way `QuantizedWeight` wraps an 8-bit one: `layers/linear.py` and the
LM head (`models/decoder.py:compute_logits`) dispatch on it. On NVIDIA GPUs it runs `pallas_kernels/invariant_matmul`
(one tile configuration for every shape, no split-K); on the CPU, where XLA's dot already reduces a row the same way
whatever the row count (the engine's CPU tests hold it), the plain dot.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

InvariantImpl = Literal["xla", "pallas", "pallas_interpret"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InvariantWeight:
    """A float weight `[in, out]` (`transposed`: `[out, in]`, the embedding-shaped LM head)."""

    w: Float[Array, "a b"]
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))
    impl: InvariantImpl = dataclasses.field(default="xla", metadata=dict(static=True))

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
    if w.impl == "xla":
        dims = (((1,), (1 if w.transposed else 0,)), ((), ()))
        return jax.lax.dot_general(x, w.w, dims, precision=precision,
                                   preferred_element_type=jnp.float32).astype(out_dtype)
    from pallas_kernels.invariant_matmul import invariant_matmul as kernel  # Pallas imported only where used

    return kernel(x, w.w, transposed=w.transposed, out_dtype=out_dtype, interpret=w.impl == "pallas_interpret")


def invariant_impl(platform: str) -> InvariantImpl:
    return "pallas" if platform == "gpu" else "xla"


def make_invariant(params: dict, impl: InvariantImpl, tied: bool) -> dict:
    """The model's float projections and LM head wrapped (the arrays themselves untouched). A tied model's LM head
    is the embedding table: `lm_head` then holds the same array, the embedding lookup still reads `embed`."""
    projections = ("wqkv", "wo", "w_gate_up", "w_down", "router")

    def wrap(name: str, leaf):
        if name in projections and isinstance(leaf, jax.Array) and leaf.ndim == 2 and jnp.issubdtype(leaf.dtype,
                                                                                                      jnp.floating):
            return InvariantWeight(leaf, False, impl)
        return leaf

    layers = tuple({name: wrap(name, leaf) for name, leaf in layer.items()} for layer in params["layers"])
    head = params["embed"] if tied else params["lm_head"]
    return {**params, "layers": layers, "lm_head": InvariantWeight(head, True, impl)}
