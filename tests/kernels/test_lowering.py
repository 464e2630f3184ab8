"""Lowers each kernel for an abstract H200 on the CPU: the Triton backend's own checks (power-of-two blocks, no
scalar prefetch, supported primitives) run here, which interpret mode would let pass (JAX-PALLAS.md §1.5)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels.kv_write import kernel as kv_write
from pallas_kernels.ragged_paged_attention import kernel as attention

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
S = jax.ShapeDtypeStruct
i32 = jnp.int32


def lower_for_h200(fn, *specs) -> str:
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=H200)):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "tokens,seqs,q_heads,kv_heads,head_dim,block_size,dtype,max_query_len,soft_cap,launches,table_width",
    [
        (64, 64, 32, 8, 128, 16, jnp.bfloat16, 1, None, 2, 2048),  # Llama-3-8B decode bucket: split-K + merge only
        (4096, 8, 32, 8, 128, 16, jnp.bfloat16, 4096, 30.0, 3, 2048),  # prefill, decode, merge; soft cap
        (256, 16, 8, 8, 64, 128, jnp.float32, 64, None, 3, 2048),  # MHA, d=64, big pages, f32
        (128, 4, 40, 8, 128, 32, jnp.bfloat16, 128, None, 3, 2048),  # group 5 (padded to 8)
        (64, 64, 32, 8, 128, 16, jnp.bfloat16, 1, None, 1, 32),  # tables of 512 positions: one split, no merge
        (4096, 8, 32, 8, 128, 16, jnp.bfloat16, 4096, None, 2, 16),  # prefill, then decode rows written in place
    ],
)
def test_attention_lowers_for_h200(tokens, seqs, q_heads, kv_heads, head_dim, block_size, dtype, max_query_len,
                                   soft_cap, launches, table_width):
    fn = functools.partial(attention.ragged_paged_attention, scale=head_dim ** -0.5, soft_cap=soft_cap,
                           max_query_len=max_query_len)
    text = lower_for_h200(
        lambda q, kv, layer, qsl, lens, bt, window: fn(q, kv, layer, qsl, lens, bt, sliding_window=window),
        S((tokens, q_heads, head_dim), dtype),
        S((32, 20000, block_size, 2, kv_heads, head_dim), dtype),  # > 4 GiB: 64-bit page offsets
        S((), i32), S((seqs + 1,), i32), S((seqs,), i32), S((seqs, table_width), i32), S((), i32),
    )
    assert text.count("__gpu$xla.gpu.triton") == launches


def test_kv_write_lowers_for_h200_in_place():
    text = lower_for_h200(
        kv_write.write_kv,
        S((32, 20000, 16, 2, 8, 128), jnp.bfloat16), S((), i32), S((64,), i32),
        S((64, 8, 128), jnp.bfloat16), S((64, 8, 128), jnp.bfloat16),
    )
    assert "__gpu$xla.gpu.triton" in text
    assert "tf.aliasing_output" in text or "output_operand_alias" in text


@pytest.mark.parametrize("tokens,seqs,max_query_len,launches,table_width",
                         [(64, 64, 1, 2, 2048), (4096, 8, 4096, 3, 2048), (64, 64, 1, 1, 64)])
def test_fp8_attention_lowers_for_h200(tokens, seqs, max_query_len, launches, table_width):
    """float8_e4m3fn pages with per-(layer, KV head) scales: decode bucket (split-K + merge), prefill, and a table
    within one split (its 1,024 positions: the decode kernel writes the rows, no merge)."""
    fn = functools.partial(attention.ragged_paged_attention, scale=128 ** -0.5, max_query_len=max_query_len)
    text = lower_for_h200(
        lambda q, kv, scales, layer, qsl, lens, bt: fn(q, kv, layer, qsl, lens, bt, kv_scales=scales),
        S((tokens, 32, 128), jnp.bfloat16),
        S((32, 40000, 16, 2, 8, 128), jnp.float8_e4m3fn),  # > 4 GiB of fp8: 64-bit page offsets
        S((32, 2, 8), jnp.float32),
        S((), i32), S((seqs + 1,), i32), S((seqs,), i32), S((seqs, table_width), i32),
    )
    assert text.count("__gpu$xla.gpu.triton") == launches


def test_fp8_kv_write_lowers_for_h200_in_place():
    text = lower_for_h200(
        lambda cache, layer, slots, k, v, scales: kv_write.write_kv(cache, layer, slots, k, v, kv_scales=scales),
        S((32, 20000, 16, 2, 8, 128), jnp.float8_e4m3fn), S((), i32), S((2048,), i32),
        S((2048, 8, 128), jnp.bfloat16), S((2048, 8, 128), jnp.bfloat16), S((32, 2, 8), jnp.float32),
    )
    assert "__gpu$xla.gpu.triton" in text
    assert "tf.aliasing_output" in text or "output_operand_alias" in text


@pytest.mark.parametrize("tokens,weight_dtype", [(1, jnp.bfloat16), (16, jnp.bfloat16), (4096, jnp.bfloat16),
                                                (64, jnp.float8_e4m3fn)])
def test_grouped_matmul_lowers_for_h200(tokens, weight_dtype):
    """The MoE experts' three launches (gate/up, down, the combine) at decode and prefill tiles (Qwen3-30B-A3B layer
    shape), narrow weights too."""
    from pallas_kernels.grouped_matmul import ExpertWeights, moe_experts

    e, d, inter, k = 128, 2048, 768, 8
    scaled = weight_dtype != jnp.bfloat16
    w = [S((e, d, inter), weight_dtype), S((e, d, inter), weight_dtype), S((e, inter, d), weight_dtype)]
    scales = [S((e, inter), jnp.float32), S((e, inter), jnp.float32), S((e, d), jnp.float32)] if scaled else []
    fn = lambda x, ex, rw, *ws: moe_experts(x, ExpertWeights(*ws), ex, rw, act=jax.nn.silu)
    text = lower_for_h200(fn, S((tokens, d), jnp.bfloat16), S((tokens, k), i32), S((tokens, k), jnp.bfloat16),
                          *w, *scales)
    assert text.count("__gpu$xla.gpu.triton") == 3


@pytest.mark.parametrize("tokens,num_experts,k", [(1, 128, 8), (256, 60, 4), (64, 8, 2)])
def test_moe_top_k_lowers_for_h200(tokens, num_experts, k):
    from pallas_kernels.grouped_matmul.router import top_k_routing

    text = lower_for_h200(lambda l: top_k_routing(l, k, True), S((tokens, num_experts), jnp.float32))
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("tokens", [1, 16])
def test_listed_routing_and_experts_lower_for_h200(tokens):
    """The decode step's MoE as the engine runs it with `PallasExperts.list_chosen`: the router (padding rows
    routed nowhere, the chosen experts listed), both expert launches reading the list, the combine."""
    from pallas_kernels.grouped_matmul import ExpertWeights, moe_experts
    from pallas_kernels.grouped_matmul.router import top_k_routing_listed

    e, d, inter, k = 128, 2048, 768, 8

    def layer(residual):
        def run(x, logits, n, *ws):
            weights, experts, chosen = top_k_routing_listed(logits, k, True, num_tokens=n)
            return moe_experts(x, ExpertWeights(*ws), experts, weights, act=jax.nn.silu, chosen=chosen,
                               residual=x if residual else None)
        return run

    bf16 = jnp.bfloat16
    shapes = (S((tokens, d), bf16), S((tokens, e), jnp.float32), S((), i32), S((e, d, inter), bf16),
              S((e, d, inter), bf16), S((e, inter, d), bf16))
    plain, fused = (lower_for_h200(layer(residual), *shapes) for residual in (False, True))
    assert plain.count("__gpu$xla.gpu.triton") == fused.count("__gpu$xla.gpu.triton") == 4
    assert fused.count("stablehlo.add") == plain.count("stablehlo.add")  # the residual add is in the combine


@pytest.mark.parametrize("tokens,group,act_order", [(16, 128, False), (4096, 128, False), (64, 32, False),
                                                     (16, 128, True), (4096, 128, True)])
def test_int4_grouped_matmul_lowers_for_h200(tokens, group, act_order):
    """4-bit experts (int32 words, float16 group scales and zero points, as AWQ/GPTQ store them) at decode and prefill
    tiles on the Qwen3-30B-A3B layer shape; GPTQ's activation order gathers x's features per expert."""
    from pallas_kernels.grouped_matmul import ExpertWeights, moe_experts

    e, d, inter, k = 128, 2048, 768, 8
    w = [S((e, d // 8, inter), i32), S((e, d // 8, inter), i32), S((e, inter // 8, d), i32)]
    per_group = [S((e, d // group, inter), jnp.float16)] * 2 + [S((e, inter // group, d), jnp.float16)]
    fn = lambda x, ex, rw, *ws: moe_experts(x, ExpertWeights(*ws), ex, rw, act=jax.nn.silu)
    perm = [S((e, d), i32)] if act_order else []
    text = lower_for_h200(fn, S((tokens, d), jnp.bfloat16), S((tokens, k), i32), S((tokens, k), jnp.bfloat16),
                          *w, *per_group, *per_group, *perm)
    assert text.count("__gpu$xla.gpu.triton") == 3  # gate/up, down, the combine


@pytest.mark.parametrize("tokens", [16, 4096])
def test_block_scaled_fp8_grouped_matmul_lowers_for_h200(tokens):
    """Qwen3-30B-A3B-FP8's experts: float8 weights with one scale per 128 × 128 block, applied per K step."""
    from pallas_kernels.grouped_matmul import ExpertWeights, moe_experts

    e, d, inter, k = 128, 2048, 768, 8
    f8 = jnp.float8_e4m3fn
    w = [S((e, d, inter), f8), S((e, d, inter), f8), S((e, inter, d), f8)]
    scales = [S((e, d // 128, inter // 128), jnp.float32)] * 2 + [S((e, inter // 128, d // 128), jnp.float32)]
    fn = lambda x, ex, rw, *ws: moe_experts(x, ExpertWeights(*ws), ex, rw, act=jax.nn.silu, scale_block=(128, 128))
    text = lower_for_h200(fn, S((tokens, d), jnp.bfloat16), S((tokens, k), i32), S((tokens, k), jnp.bfloat16),
                          *w, *scales)
    assert text.count("__gpu$xla.gpu.triton") == 3  # gate/up, down, the combine


def test_add_rms_norm_lowers_for_h200():
    """The residual add fused into the RMSNorm: one Triton launch for an 8B hidden state."""
    from pallas_kernels.invariant_matmul.rows import add_rms_norm_rows

    text = lower_for_h200(lambda x, d, w: add_rms_norm_rows(x, d, w, eps=1e-5), S((64, 4096), jnp.bfloat16),
                          S((64, 4096), jnp.bfloat16), S((4096,), jnp.bfloat16))
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("tokens,seqs,max_query_len,launches", [(64, 64, 1, 2), (4096, 8, 4096, 3)])
def test_fp8_attention_with_float16_operands_lowers_for_h200(tokens, seqs, max_query_len, launches):
    """`Tuning.fp8_operands="float16"`: e4m3 pages unpacked to float16 and the query scaled into its range."""
    import dataclasses

    from pallas_kernels.ragged_paged_attention.tuning import default_tuning

    tuning = dataclasses.replace(default_tuning(128, 4, quantized=True), fp8_operands="float16")
    fn = functools.partial(attention.ragged_paged_attention_impl, scale=128 ** -0.5, sliding_window=0,
                           soft_cap=None, max_query_len=max_query_len, interpret=False, tuning=tuning)
    text = lower_for_h200(
        lambda q, kv, scales, layer, qsl, lens, bt: fn(q, kv, layer, qsl, lens, bt, kv_scales=scales),
        S((tokens, 32, 128), jnp.bfloat16), S((32, 40000, 16, 2, 8, 128), jnp.float8_e4m3fn),
        S((32, 2, 8), jnp.float32), S((), i32), S((seqs + 1,), i32), S((seqs,), i32), S((seqs, 2048), i32),
    )
    assert text.count("__gpu$xla.gpu.triton") == launches
    assert "f16" in text


def test_rms_norm_pair_lowers_for_h200():
    from pallas_kernels.invariant_matmul.rows import rms_norm_pair_rows

    text = lower_for_h200(lambda a, b, wa, wb: rms_norm_pair_rows(a, b, wa, wb, eps=1e-6),
                          S((64, 32, 128), jnp.bfloat16), S((64, 4, 128), jnp.bfloat16), S((128,), jnp.bfloat16),
                          S((128,), jnp.bfloat16))
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("tokens,seqs,max_query_len,split,width,launches", [
    (64, 64, 1, None, 2048, 2), (4096, 8, 4096, None, 2048, 3), (64, 64, 1, 2048, 2048, 2),
    (64, 64, 1, 2048, 128, 1), (64, 1, 64, 2048, 2048, 3)],
    ids=["decode", "prefill", "decode-chunks", "decode-one-chunk", "short-step-chunks"])
def test_segmented_invariant_attention_lowers_for_h200(tokens, seqs, max_query_len, split, width, launches):
    """The batch-invariant mode with 2,048-position segments over 32k tables: decode splits and the merge, and the
    prefill kernel folding its rows' segments; with 512-position segments walked four a decode program
    (`invariant_split`): over 32k tables, and over a 2k table (one chunk: the program folds them, no merge); a short
    step's segments walked in one program (the shipped default)."""
    segment = 2048 if split is None else 512
    fn = functools.partial(attention.ragged_paged_attention, scale=128 ** -0.5, max_query_len=max_query_len,
                           single_path=True, invariant_segment=segment, invariant_split=split)
    text = lower_for_h200(
        lambda q, kv, layer, qsl, lens, bt: fn(q, kv, layer, qsl, lens, bt),
        S((tokens, 32, 128), jnp.bfloat16), S((32, 20000, 16, 2, 8, 128), jnp.bfloat16),
        S((), i32), S((seqs + 1,), i32), S((seqs,), i32), S((seqs, width), i32),
    )
    assert text.count("__gpu$xla.gpu.triton") == launches


@pytest.mark.parametrize("tokens,seqs,max_query_len,launches,fp8", [
    (64, 64, 1, 2, False), (64, 1, 64, 4, False), (4096, 8, 4096, 3, False), (64, 64, 1, 2, True),
    (4096, 8, 4096, 3, True)], ids=["decode", "short-step", "prefill", "fp8-decode", "fp8-prefill"])
def test_prefetching_attention_lowers_for_h200(tokens, seqs, max_query_len, launches, fp8):
    """`KernelConfig.prefetch_pages` (page ids carried a KV step ahead) in every kernel, the batch-invariant
    mode's segments and a short step's 64-row tiles (`Tuning.short_prefill`) included; a float8 cache too. The
    short step's table spans 16 segments: with `parallel_short_segments` its prefill runs a program per segment and
    their merge (4 launches)."""
    import dataclasses

    from pallas_kernels.ragged_paged_attention.tuning import KernelConfig, default_tuning

    base = default_tuning(128, 4, quantized=fp8)
    ahead = functools.partial(dataclasses.replace, prefetch_pages=True)
    tuning = dataclasses.replace(base, decode=ahead(base.decode), prefill=ahead(base.prefill), invariant_segment=2048,
                                 short_prefill=KernelConfig(64, 128, 4, 2, prefetch_pages=True),
                                 parallel_short_segments=True)
    fn = functools.partial(attention.ragged_paged_attention_impl, scale=128 ** -0.5, sliding_window=0,
                           soft_cap=None, max_query_len=max_query_len, interpret=False, tuning=tuning,
                           single_path=not fp8)
    text = lower_for_h200(
        lambda q, kv, scales, layer, qsl, lens, bt: fn(q, kv, layer, qsl, lens, bt, kv_scales=scales if fp8 else None),
        S((tokens, 32, 128), jnp.bfloat16),
        S((32, 20000, 16, 2, 8, 128), jnp.float8_e4m3fn if fp8 else jnp.bfloat16),
        S((32, 2, 8), jnp.float32), S((), i32), S((seqs + 1,), i32), S((seqs,), i32), S((seqs, 2048), i32),
    )
    assert text.count("__gpu$xla.gpu.triton") == launches
