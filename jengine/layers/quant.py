"""Quantized projections: 8-bit weights (float8 e4m3 or int8) with float32 scales, and their matmuls.

A `QuantizedWeight` is a small pytree that `layers/linear.py:linear` dispatches on, so every projection of every
family takes it where it took a plain `[in, out]` array. One layout serves every on-disk format (the loader converts
each, `models/quant_load.py`): the logical `[K, N]` weight with `scale [..., ceil(K / block_k), ceil(N / block_n)]`,
the real weight being `weight × scale` with each scale covering one `block_k × block_n` tile. Per-tensor and
per-channel scales are blocks of `(K, 1)` (`block_k = 0`: the whole input axis), DeepSeek/Qwen3's 128 × 128 blocks
are `(128, 128)`, group-wise weight-only scales `(group, 1)`.

The 8-bit values are stored input-minor and group-major, `[..., K / g, N, g]` with `g = block_k` (or K; K
zero-padded to whole groups): cuBLASLt's FP8 and int8 GEMMs take both operands contracting on their minor dimension
(the "TN" layout; any other makes XLA transpose the weight at every call), and a block-scaled weight then splits into
its K groups as a batch dimension that is already major, so neither path copies the weight. Expert stacks keep the
float layout `[experts, K, N]` (`kn`), which the grouped-matmul kernels read with one scale per (expert, column).

Implementations, chosen once at load (`QuantScheme.impl`):
- `reference` (the CPU): dequantize to float32, then one matmul. The oracle.
- `emulated` (checks of the GPU paths): as `reference`, with the activations rounded to 8 bits and back as `xla`
  rounds them first, so a deep model's logits compare like with like (only the accumulation order differs).
- `xla` (GPUs): at decode-sized steps (`WEIGHT_ONLY_MAX_TOKENS` rows or fewer) float8 weights are upcast inside
  the dot and the activations stay unquantized: such a step only reads weights, and the H200 ran the Llama-3.1-8B
  decode step at 3.91 ms so against 4.41 ms with the activations quantized for the FP8 GEMM (per channel; 3.94 ms
  block-scaled; bfloat16 4.77 ms). Otherwise the activations are quantized in the step (per token, or per token and
  128-group for block scales; or with the checkpoint's static scale) and an 8-bit × 8-bit dot whose scales apply to
  its output:
  float8 × float8 runs on the FP8 tensor cores (XLA's `__cublas$lt$matmul$f8`), int8 × int8 on the int8 ones;
  weight-only schemes upcast inside the dot. Block-scaled weights at few tokens run one dot per 128-wide input group
  (batched), the groups weighted by their scales and summed. At many tokens (compute-bound) a block-scaled weight
  is rescaled in the step to one scale per output feature, the largest of its column's block scales (each value
  multiplied by its block's scale ÷ that one, at most 1, and rounded to 8 bits again: one more rounding, in exchange
  for the per-channel FP8 GEMM's rate), and activations per token; weight-only schemes are dequantized and
  multiplied at the activations' precision.
- `pallas` (`pallas_interpret` in CPU tests): decode-sized steps of per-channel weights through a Triton kernel
  that reads each 8-bit weight tile once and upcasts it in registers, activations unquantized
  (`pallas_kernels/quant_matmul`); everything else as `xla`. One device only for now (a tensor-parallel engine
  keeps `xla`, which GSPMD partitions), so the loader picks `xla`; the benchmark measures both.
- `mosaic` (`mosaic_interpret` in CPU tests): per-channel weight-only steps (int8 or float8 W8A16, and float8 W8A8
  at the `WEIGHT_ONLY_MAX_TOKENS` rows that run weight-only) of up to `MOSAIC_MAX_ROWS` bfloat16 rows through the
  Mosaic GPU kernel of `pallas_kernels/weight_only` (Hopper: the weight streamed by TMA, upcast in registers, wgmma
  with the weight as the 64-row operand); everything else as `xla`. One device, as `pallas`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
# Batched per-group dots (block scales) up to this many tokens: their float32 partial sums are tokens × groups × N.
GROUPED_MAX_TOKENS = 32
PALLAS_MAX_TOKENS = 16  # pallas_kernels.quant_matmul's one row tile
WEIGHT_ONLY_MAX_TOKENS = 16  # float8 W8A8 at up to this many rows runs as W8A16 (the `xla` bullet above)
MOSAIC_MAX_ROWS = 64  # rows the Mosaic weight-only kernel takes (the `mosaic` bullet above)

Impl = Literal["reference", "emulated", "xla", "pallas", "pallas_interpret", "mosaic", "mosaic_interpret"]
Activations = Literal["fp8", "int8"] | None


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How a `QuantizedWeight` is stored and multiplied. Hashable: a static part of the pytree."""

    weight_dtype: Literal["fp8", "int8"]
    activations: Activations  # quantized in the step as this type; None: weight-only (W8A16)
    block_k: int = 0  # input features per scale (0: all of them, i.e. per-channel or per-tensor)
    block_n: int = 1  # output features per scale
    act_group: int = 0  # dynamic activation scales per token and this many features (0: per token)
    impl: Impl = "reference"

    @property
    def label(self) -> str:
        """A short name for start-up logs: fp8-w8a8 block 128x128, int8-w8a16 group 32, ..."""
        acts = f"a{8 if self.activations else 16}"
        if self.block_k == 0:
            kind = "channel"
        elif self.block_n == 1 and self.activations is None:
            kind = f"group {self.block_k}"
        else:
            kind = f"block {self.block_k}x{self.block_n}"
        return f"{self.weight_dtype}-w8{acts} {kind}"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """An 8-bit projection in our `[in, out]` layout (a leading expert axis for MoE stacks)."""

    weight: Array  # [..., K / g, N, g] float8_e4m3fn or int8 (the module docstring says why this layout)
    scale: Array  # [..., ceil(K / block_k), ceil(N / block_n)] float32; block_k = 0: one row
    input_scale: Array | None  # static activation scale (float32 scalar); None: dynamic
    scheme: QuantScheme = dataclasses.field(metadata=dict(static=True))
    in_features: int = dataclasses.field(default=0, metadata=dict(static=True))  # K before padding to whole groups
    kn: bool = dataclasses.field(default=False, metadata=dict(static=True))  # stored [..., K, N] (expert stacks)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical `[..., K, N]`, as a float weight's."""
        if self.kn:
            return self.weight.shape
        return (*self.weight.shape[:-3], self.in_features, self.weight.shape[-2])

    @classmethod
    def from_kn(cls, weight: Array, scale: Array, input_scale: Array | None, scheme: QuantScheme,
                keep_kn: bool = False) -> QuantizedWeight:
        """From 8-bit values in the `[..., K, N]` layout of float weights (numpy on the host, or device arrays);
        `keep_kn` stores them so (expert stacks)."""
        *lead, k, n = weight.shape
        if keep_kn:
            return cls(weight, scale, input_scale, scheme, k, True)
        xp = np if isinstance(weight, np.ndarray) else jnp
        g = scheme.block_k or k
        groups = -(-k // g)
        padded = xp.pad(weight, [(0, 0)] * len(lead) + [(0, groups * g - k), (0, 0)])
        stored = xp.swapaxes(padded.reshape(*lead, groups, g, n), -1, -2)
        return cls(stored, scale, input_scale, scheme, k)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.input_scale is None else self.input_scale.nbytes
        return self.weight.nbytes + self.scale.nbytes + extra


def expand_scale(scale: Float[Array, "... kg ng"], scheme: QuantScheme, k: int, n: int) -> Float[Array, "... k n"]:
    """Each scale repeated over the tile it covers (`block_k = 0`: broadcast over K), cut to `[k, n]`."""
    if scheme.block_k:
        scale = jnp.repeat(scale, scheme.block_k, axis=-2)[..., :k, :]
    if scheme.block_n > 1:
        scale = jnp.repeat(scale, scheme.block_n, axis=-1)[..., :n]
    return scale


def dequantize(q: QuantizedWeight, dtype=jnp.float32) -> Array:
    """The real `[..., K, N]` weight, `weight × scale`, computed in float32 and returned as `dtype` (the MoE
    experts' hook)."""
    if q.kn:
        k, n = q.weight.shape[-2:]
        return (q.weight.astype(jnp.float32) * expand_scale(q.scale, q.scheme, k, n)).astype(dtype)
    *lead, groups, n, g = q.weight.shape
    per_group = expand_scale(q.scale, dataclasses.replace(q.scheme, block_k=1), groups, n)
    w = q.weight.astype(jnp.float32) * per_group[..., None]
    return jnp.swapaxes(w, -1, -2).reshape(*lead, groups * g, n)[..., : q.in_features, :].astype(dtype)


def quantize_activations(
    x: Float[Array, "tokens k"], kind: Literal["fp8", "int8"], static_scale: Array | None = None, group: int = 0
) -> tuple[Array, Float[Array, "tokens groups"]]:
    """x → (8-bit x, float32 scales): one scale per token (per token and `group` features when set), or the static
    one. Float8 is clipped before the cast (an out-of-range cast gives NaN, not the largest value)."""
    top = FP8_MAX if kind == "fp8" else INT8_MAX
    xf = x.astype(jnp.float32)
    if static_scale is not None:
        scale = jnp.broadcast_to(static_scale.astype(jnp.float32).reshape(1, 1), (x.shape[0], 1))
    else:
        grouped = xf.reshape(x.shape[0], -1, group) if group else xf[:, None, :]
        scale = jnp.maximum(jnp.max(jnp.abs(grouped), axis=-1) / top, jnp.finfo(jnp.float32).tiny)
    per_feature = jnp.repeat(scale, group, axis=-1) if group and static_scale is None else scale
    scaled = jnp.clip(xf / per_feature, -top, top)
    return (scaled.astype(FP8) if kind == "fp8" else jnp.round(scaled).astype(jnp.int8)), scale


def quantized_matmul(x: Float[Array, "tokens k"], q: QuantizedWeight, precision=None) -> Float[Array, "tokens n"]:
    """x @ (weight × scale), in x's dtype, by the scheme's implementation."""
    if q.scheme.impl.startswith("mosaic"):
        if _mosaic_takes(x, q):
            return _mosaic_matmul(x, q)
        q = dataclasses.replace(q, scheme=dataclasses.replace(q.scheme, impl="xla"))
    if _weight_only_at_few_tokens(x, q):
        q = dataclasses.replace(q, scheme=dataclasses.replace(q.scheme, activations=None, act_group=0))
    if q.scheme.impl in ("reference", "emulated"):
        if q.scheme.impl == "emulated" and _rescaled_per_channel(x, q):
            q = _per_channel(q)  # as the device path at many tokens (its extra weight rounding and per-token scales)
        xf = _rounded_activations(x, q) if q.scheme.impl == "emulated" else x.astype(jnp.float32)
        w = dequantize(q)
        y = jnp.dot(jnp.pad(xf, ((0, 0), (0, w.shape[0] - xf.shape[1]))), w, precision=jax.lax.Precision.HIGHEST)
        return y.astype(x.dtype)
    if q.scheme.impl.startswith("pallas") and q.scheme.block_k == 0 and x.shape[0] <= PALLAS_MAX_TOKENS:
        from pallas_kernels.quant_matmul import FewTokenConfig, few_token_matmul  # Pallas imported only where used

        return few_token_matmul(x, q.weight[0], column_scales(q), interpret=q.scheme.impl == "pallas_interpret",
                                **FewTokenConfig().kernel_args(*q.weight[0].shape))
    if q.scheme.block_k == 0:
        return _channel_matmul(x, q)
    if x.shape[0] <= GROUPED_MAX_TOKENS:
        return _grouped_matmul(x, q)
    if _rescaled_per_channel(x, q):
        return _channel_matmul(x, _per_channel(q))
    return jnp.dot(x, dequantize(q, x.dtype), precision=precision, preferred_element_type=jnp.float32).astype(x.dtype)


def _mosaic_takes(x: Float[Array, "tokens k"], q: QuantizedWeight) -> bool:
    """Whether the Mosaic weight-only kernel serves this step: a per-channel weight-only step (int8 or float8 W8A16,
    or float8 W8A8 at the few rows that run weight-only), few bfloat16 rows, tiles that fit (64 output features,
    128-input steps)."""
    from pallas_kernels.weight_only.kernel import fits

    n, k = q.weight.shape[-2:]
    weight_only = q.scheme.activations is None or (
        q.scheme.weight_dtype == "fp8" and q.scheme.activations == "fp8" and x.shape[0] <= WEIGHT_ONLY_MAX_TOKENS)
    return (weight_only and q.scheme.block_k == 0 and not q.kn and q.weight.ndim == 3 and x.dtype == jnp.bfloat16
            and x.shape[0] <= MOSAIC_MAX_ROWS and fits(k, n, group=k) and k == x.shape[1])


def _mosaic_matmul(x: Float[Array, "tokens k"], q: QuantizedWeight) -> Float[Array, "tokens n"]:
    from pallas_kernels.weight_only.kernel import fitted_matmul  # Pallas imported only where used

    return fitted_matmul(x, q.weight[0], column_scales(q)[None, :], interpret=q.scheme.impl == "mosaic_interpret")


def _weight_only_at_few_tokens(x: Float[Array, "tokens k"], q: QuantizedWeight) -> bool:
    """Whether the device math (and its emulation) takes this float8 W8A8 weight as weight-only at this step size."""
    return (q.scheme.impl in ("xla", "emulated") and q.scheme.weight_dtype == "fp8" and q.scheme.activations == "fp8"
            and x.shape[0] <= WEIGHT_ONLY_MAX_TOKENS and not q.kn)


def _rescaled_per_channel(x: Float[Array, "tokens k"], q: QuantizedWeight) -> bool:
    """Whether the device math takes a block-scaled weight with quantized activations as per-channel (many tokens)."""
    return q.scheme.block_k != 0 and q.scheme.activations is not None and x.shape[0] > GROUPED_MAX_TOKENS


def _rounded_activations(x: Float[Array, "tokens k"], q: QuantizedWeight) -> Float[Array, "tokens k"]:
    """x after the 8-bit rounding the `xla` path gives it (unchanged for weight-only schemes), in float32."""
    kind, group = q.scheme.activations, q.scheme.act_group
    if kind is None:
        return x.astype(jnp.float32)
    k = x.shape[1]
    if group:  # whole groups, as the grouped path pads them
        x = jnp.pad(x, ((0, 0), (0, -k % group)))
    xq, scale = quantize_activations(x, kind, q.input_scale, group)
    per_feature = jnp.repeat(scale, group, axis=-1) if group and q.input_scale is None else scale
    return (xq.astype(jnp.float32) * per_feature)[:, :k]


def _dot_nk(a: Float[Array, "t k"], b: Array, out) -> Float[Array, "t n"]:
    """a @ bᵀ for b `[n, k]`: both operands contract on their minor dimension."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=out)


def _channel_matmul(x: Float[Array, "tokens k"], q: QuantizedWeight) -> Float[Array, "tokens n"]:
    """One scale per output feature (and per token for the activations), applied to the dot's float32 output."""
    scheme, w = q.scheme, q.weight[0]  # [N, K] (K zero-padded where a block-scaled weight was rescaled)
    w_scale = expand_scale(q.scale, scheme, 1, w.shape[0])[0]
    x = jnp.pad(x, ((0, 0), (0, w.shape[1] - x.shape[1])))
    if scheme.activations is None:
        y = _dot_nk(x, w.astype(x.dtype), jnp.float32)
        return (y * w_scale).astype(x.dtype)
    xq, x_scale = quantize_activations(x, scheme.activations, q.input_scale)
    # cuBLASLt's FP8 GEMM fuses scalar scales only: per-token × per-channel ones apply after it, so its output is
    # written and read once more. bfloat16 there (the FP8 rounding of x already costs far more than its rounding)
    # halves that traffic: at a 4k-token prefill a float32 [4096, 43008] per layer is 0.7 GB more to move.
    out = (x.dtype if x.dtype == jnp.bfloat16 else jnp.float32) if scheme.activations == "fp8" else jnp.int32
    y = _dot_nk(xq, w, out).astype(jnp.float32)
    return (y * x_scale * w_scale).astype(x.dtype)


def _per_channel(q: QuantizedWeight) -> QuantizedWeight:
    """A block-scaled weight as a per-channel one: each column's scale the largest of its block scales, each value
    times its block's scale ÷ that one (≤ 1), rounded to 8 bits again. One elementwise pass over the weight."""
    groups, n, g = q.weight.shape
    per_group = expand_scale(q.scale, dataclasses.replace(q.scheme, block_k=1), groups, n)  # [groups, N]
    column = jnp.max(per_group, axis=0)
    w = q.weight.astype(jnp.float32) * (per_group / column)[:, :, None]
    w = jnp.swapaxes(w, 0, 1).reshape(1, n, groups * g)
    w = jnp.clip(w, -FP8_MAX, FP8_MAX).astype(FP8) if q.scheme.weight_dtype == "fp8" else jnp.round(w).astype(jnp.int8)
    scheme = dataclasses.replace(q.scheme, block_k=0, block_n=1, act_group=0)
    return QuantizedWeight(w, column[None, :], q.input_scale, scheme, groups * g)


def _grouped_matmul(x: Float[Array, "tokens k"], q: QuantizedWeight) -> Float[Array, "tokens n"]:
    """Block scales at few tokens: one dot per `block_k` input features (a batched dot over the groups), each
    group's float32 partial sums weighted by its scales, then summed (x and the weight zero-padded to whole groups)."""
    scheme, w = q.scheme, q.weight  # [groups, N, g]
    tokens, (groups, n, g) = x.shape[0], w.shape
    xp = jnp.pad(x, ((0, 0), (0, groups * g - x.shape[1])))
    if scheme.activations is None:
        lhs, x_scale, out = xp.reshape(tokens, groups, g), None, jnp.float32
        w = w.astype(x.dtype)
    else:
        lhs, x_scale = quantize_activations(xp, scheme.activations, q.input_scale, group=scheme.act_group)
        lhs, out = lhs.reshape(tokens, groups, g), jnp.float32 if scheme.activations == "fp8" else jnp.int32
    partial = jax.lax.dot_general(lhs, w, (((2,), (2,)), ((1,), (0,))), preferred_element_type=out)  # [g, t, n]
    weights = expand_scale(q.scale, dataclasses.replace(scheme, block_k=1), groups, n)[:, None, :]
    if x_scale is not None:
        weights = weights * (x_scale.T[:, :, None] if x_scale.shape[1] == groups else x_scale[None])
    return jnp.sum(partial.astype(jnp.float32) * weights, axis=0).astype(x.dtype)


def column_scales(q: QuantizedWeight) -> Float[Array, "... n"] | None:
    """One scale per output column (and expert), when the weight has them (`block_k = 0`), else None."""
    if q.scheme.block_k:
        return None
    return expand_scale(q.scale, q.scheme, 1, q.shape[-1])[..., 0, :]


def workspace_bytes(params, dtype, platform: str = "cpu") -> int:
    """Device memory a step needs beyond the weights for quantized ones: the largest copy the matmuls make of one
    weight (an 8-bit expert stack dequantized for the grouped matmul, two alive at once; a block-scaled weight
    rescaled to per-channel, or a weight-only one dequantized, at prefill; a 4-bit one at prefill, where every
    implementation multiplies a dequantized copy; a 4-bit expert stack off the GPU, where `ragged_dot` takes it
    dequantized). The KV planner reserves it."""
    from jengine.layers.quant4 import Int4Experts, Int4Weight

    sizes = [0]
    quantized = (QuantizedWeight, Int4Weight, Int4Experts)
    for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, quantized)):
        if isinstance(leaf, Int4Weight):  # every path dequantizes a copy at prefill-sized steps (then cuBLAS)
            sizes.append(int(np.prod(leaf.shape)) * jnp.dtype(dtype).itemsize)
        elif isinstance(leaf, Int4Experts):  # the grouped-matmul kernels read the words; ragged_dot a float copy
            sizes.append(2 * int(np.prod(leaf.shape)) * jnp.dtype(dtype).itemsize if platform != "gpu" else 0)
        elif isinstance(leaf, QuantizedWeight):
            elements = int(np.prod(leaf.shape))
            experts = len(leaf.shape) > 2
            sizes.append(2 * elements * jnp.dtype(dtype).itemsize if experts else
                         elements * (1 if leaf.scheme.activations else jnp.dtype(dtype).itemsize))
    return max(sizes)


def quantize_weight_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Host-side float8 quantization of a float `[..., K, N]` weight with one scale per output feature (and expert):
    what `--quantization fp8` does to a float checkpoint at load. Returns (float8 `[..., K, N]`, `[..., 1, N]`
    scales)."""
    import ml_dtypes

    wf = np.asarray(w, np.float32)
    scale = np.maximum(np.abs(wf).max(axis=-2, keepdims=True) / FP8_MAX, np.finfo(np.float32).tiny)
    return np.clip(wf / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn), scale.astype(np.float32)
