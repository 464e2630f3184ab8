"""The MoE grouped-matmul kernels (Pallas interpret mode) against a float64 numpy reference, the MoE layer through
them against the `ragged_dot` path (alone, with bucket padding, under TP and EP), and a whole MoE model's greedy
output through them against the reference backend's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import Qwen3MoeConfig

from pallas_kernels.grouped_matmul import ExpertWeights, TileConfig, expert_tiles, moe_experts
from pallas_kernels.grouped_matmul.routing import num_slots

from jengine import LLM, SamplingParams
from jengine.attention.backend import ReferenceBackend
from jengine.layers.invariant import InvariantWeight
from jengine.layers.mlp import PallasExperts, moe_mlp, moe_mlp_expert_parallel
from jengine.models.spec import MoeSpec
from jengine.parallel.mesh import TP_AXIS
from tests.conftest import COMMON, fresh_seed

SEED = fresh_seed()
SMALL = (TileConfig(block_rows=16, block_n=32, block_k=32), TileConfig(block_rows=16, block_n=32, block_k=32))


def numpy_experts(x, w: ExpertWeights, experts, routing) -> np.ndarray:
    """float64, one (token, choice) at a time; pairs with an expert id outside the range contribute nothing."""
    f = lambda a: np.asarray(a, np.float64)
    x, gate, up, down = f(x), f(w.gate), f(w.up), f(w.down)
    out = np.zeros_like(x)
    for t, j in np.ndindex(*experts.shape):
        e = int(experts[t, j])
        if 0 <= e < gate.shape[0]:
            g, u = x[t] @ gate[e], x[t] @ up[e]
            out[t] += float(routing[t, j]) * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


def leave_empty(experts: np.ndarray, expert: int) -> None:
    """Moves every choice of `expert` to an expert its token has not chosen (a router's k choices are distinct)."""
    for t, j in zip(*np.nonzero(experts == expert)):
        experts[t, j] = next(e for e in range(experts.max() + 2) if e != expert and e not in experts[t])


def give_all(experts: np.ndarray, expert: int) -> None:
    """Every token's first choice becomes `expert` (its other choices moved off it, to stay distinct)."""
    experts[:, 1:][experts[:, 1:] == expert] = -2
    experts[:, 0] = expert
    for t, j in zip(*np.nonzero(experts == -2)):
        experts[t, j] = next(e for e in range(experts.max() + 2) if e not in experts[t])


def random_case(rng, tokens, experts_n, k, d, inter, dtype):
    w = ExpertWeights(*(jnp.asarray(rng.standard_normal(s) * s[1] ** -0.5, dtype)
                        for s in ((experts_n, d, inter), (experts_n, d, inter), (experts_n, inter, d))))
    x = jnp.asarray(rng.standard_normal((tokens, d)), dtype)
    experts = np.stack([rng.choice(experts_n, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    routing = jnp.asarray(rng.random((tokens, k)), dtype)
    return x, w, experts, routing


@pytest.mark.parametrize("workers_per_sm", [0, 1], ids=["tile_grid", "workers"])
@pytest.mark.parametrize("order", ["sorted", "by_token"])
@pytest.mark.parametrize("layout", ["random", "one_expert_takes_all", "skipped_and_empty"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_match_float64(layout, dtype, order, workers_per_sm):
    """Both row layouts: expert tiles of sorted slots, and by token (21 tokens: one 32-row tile per expert); both
    grids: a program per tile, and the interpreter's 8 "SMs" looping over the tiles with rows (several each)."""
    rng = np.random.default_rng(SEED)
    # d and inter not multiples of the tiles: ragged edges masked in K and N
    x, w, experts, routing = random_case(rng, 21, 6, 2, 48, 40, dtype)
    if layout == "one_expert_takes_all":
        give_all(experts, 4)  # 21 rows in one expert: two tiles of it
    if layout == "skipped_and_empty":
        experts[::2, 1] = -1  # another device's experts under expert parallelism
        leave_empty(experts, 2)  # expert 2 gets no rows at all (its weights never read)
    configs = tuple(dataclasses.replace(c, workers_per_sm=workers_per_sm) for c in SMALL)
    got = moe_experts(x, w, jnp.asarray(experts), routing, act=jax.nn.silu, interpret=True, configs=configs,
                      precision=jax.lax.Precision.HIGHEST, layout=order)
    want = numpy_experts(x, w, experts, routing)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2  # bf16: the hidden rows are stored in bf16 between the launches
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("tokens", [24, 40], ids=["32_row_tiles", "64_row_tiles"])
def test_default_tiles_match_float64(tokens):
    """The engine's own tiles (`tile_configs`: rows twice the mean rows per expert, K steps shortened to match) on a
    sorted step, against float64."""
    from pallas_kernels.grouped_matmul import tile_configs

    rng = np.random.default_rng(SEED + 2)
    x, w, experts, routing = random_case(rng, tokens, 4, 2, 48, 40, jnp.float32)
    assert tile_configs(tokens * 2, 4)[0].block_rows == (32 if tokens == 24 else 64)
    got = moe_experts(x, w, jnp.asarray(experts), routing, act=jax.nn.silu, interpret=True,
                      precision=jax.lax.Precision.HIGHEST, layout="sorted")
    want = numpy_experts(x, w, experts, routing)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5 * np.abs(want).max(), rtol=0)


MOE = MoeSpec(num_experts=8, num_experts_per_tok=3, intermediate_size=24, norm_topk_prob=True, weight_style="qwen")


def layer_weights(rng, d=32):
    shape = {"router": (d, 8), "we_gate": (8, d, 24), "we_up": (8, d, 24), "we_down": (8, 24, d)}
    return {k: jnp.asarray(rng.standard_normal(s) * s[-2] ** -0.5, jnp.float32) for k, s in shape.items()}


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("fused_router_max_tokens,list_chosen", [(0, False), (16, False), (16, True)],
                         ids=["xla_router", "fused_router", "fused_router_listing"])
def test_layer_through_kernels_matches_ragged_dot_and_skips_padding(fused_router_max_tokens, list_chosen, dtype,
                                                                    atol):
    """The layer through the kernels against `ragged_dot` (bf16: the same bf16 routing weights, sums that differ in
    order only); the bucket's padding tokens get nothing."""
    rng = np.random.default_rng(SEED + 1)
    w, x = layer_weights(rng), jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    w, x = {k: v.astype(dtype) for k, v in w.items()}, x.astype(dtype)
    hi = jax.lax.Precision.HIGHEST
    want = moe_mlp(x, w, MOE, "silu", hi)
    kernels = PallasExperts(interpret=True, fused_router_max_tokens=fused_router_max_tokens, list_chosen=list_chosen)
    got = moe_mlp(x, w, MOE, "silu", hi, kernels, jnp.int32(11))
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got[:11], np.float32), np.asarray(want[:11], np.float32), atol=atol)
    np.testing.assert_array_equal(np.asarray(got[11:]), 0)  # padding tokens routed nowhere
    # the layer's residual add, fused into the kernels' combine by token: the same as adding it after
    residual = jnp.asarray(rng.standard_normal(x.shape), dtype)
    with_residual = moe_mlp(x, w, MOE, "silu", hi, kernels, jnp.int32(11), residual)
    np.testing.assert_array_equal(np.asarray(with_residual, np.float32), np.asarray(residual + got, np.float32))


@pytest.mark.parametrize("invariant", [False, True], ids=["psum", "deterministic"])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_layer_through_kernels_sharded_over_devices(expert_parallel, invariant):
    """Split by TP (each expert's hidden features) or by expert; `--deterministic` (a batch-invariant router) adds
    the devices' partial outputs in device order: the compiled layer then holds no all-reduce."""
    rng = np.random.default_rng(SEED + 2)
    w, x = layer_weights(rng), jnp.asarray(rng.standard_normal((9, 32)), jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    want = moe_mlp(x, w, MOE, "silu", hi)
    mesh = jax.make_mesh((2,), (TP_AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
    P = jax.sharding.PartitionSpec
    specs = ({k: P(TP_AXIS) for k in ("we_gate", "we_up", "we_down")} if expert_parallel else
             {"we_gate": P(None, None, TP_AXIS), "we_up": P(None, None, TP_AXIS), "we_down": P(None, TP_AXIS)})
    w = {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, specs.get(k, P()))) for k, v in w.items()}
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P()))
    if invariant:
        w["router"] = InvariantWeight(w["router"])
    kernels = PallasExperts(interpret=True, mesh=mesh)
    if expert_parallel:
        layer = jax.jit(lambda x, w: moe_mlp_expert_parallel(x, w, MOE, "silu", hi, mesh, TP_AXIS, kernels))
    else:
        layer = jax.jit(lambda x, w: moe_mlp(x, w, MOE, "silu", hi, kernels))
    np.testing.assert_allclose(np.asarray(layer(x, w)), np.asarray(want), atol=2e-5)
    assert ("all-reduce" in layer.lower(x, w).compile().as_text()) != invariant


@dataclasses.dataclass(frozen=True)
class ReferenceAttentionKernelExperts(ReferenceBackend):
    """Reference attention, experts through the Pallas kernels in interpret mode."""

    experts: PallasExperts = PallasExperts(interpret=True)


def test_moe_model_greedy_output_unchanged_by_the_kernels(monkeypatch, build_checkpoint, tiny_tokenizer_dir):
    config = Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 2}, moe_intermediate_size=32, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True)
    model_dir, _ = build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir)
    rng = np.random.default_rng(SEED + 3)
    prompts = [{"prompt_token_ids": rng.integers(3, COMMON["vocab_size"], n).tolist()} for n in (5, 19)]
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)

    def greedy() -> list[list[int]]:
        llm = LLM(str(model_dir), dtype="float32", max_model_len=64)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()

    want = greedy()
    monkeypatch.setattr("jengine.factory.select_backend", lambda *a, **k: ReferenceAttentionKernelExperts())
    assert greedy() == want, f"seed {SEED}"


def test_float8_experts_with_column_scales():
    """Narrow experts: float8 weights times a per-(expert, output column) scale, applied to the accumulator."""
    rng = np.random.default_rng(SEED + 4)
    x, w, experts, routing = random_case(rng, 13, 4, 2, 32, 32, jnp.float32)
    scales = [jnp.asarray(rng.uniform(0.5, 2, (4, a.shape[2])), jnp.float32) for a in w[:3]]
    narrow = [jnp.clip(a / s[:, None, :], -448, 448).astype(jnp.float8_e4m3fn) for a, s in zip(w[:3], scales)]
    dequantized = ExpertWeights(*(n.astype(jnp.float32) * s[:, None, :] for n, s in zip(narrow, scales)))
    got = moe_experts(x, ExpertWeights(*narrow, *scales), jnp.asarray(experts), routing, act=jax.nn.silu,
                      interpret=True, configs=SMALL, precision=jax.lax.Precision.HIGHEST)
    want = numpy_experts(x, dequantized, experts, routing)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5 * np.abs(want).max(), rtol=0)


def numpy_layout(experts: np.ndarray, weights: np.ndarray, num_experts: int, block_rows: int):
    """The slot layout written from its definition: experts in order, each one's pairs in pair order from the start
    of its run, each run padded to a multiple of block_rows; pairs of other devices' experts get slot `slots`."""
    flat, flat_w = experts.reshape(-1), weights.reshape(-1)
    slots = num_slots(flat.size, num_experts, block_rows)
    slot_token, slot_weight = np.full(slots, -1), np.zeros(slots, np.float32)
    pair_slot, tile_expert = np.full(flat.size, slots), []
    start = 0
    for e in range(num_experts):
        mine = [p for p in range(flat.size) if flat[p] == e]
        for rank, p in enumerate(mine):
            slot = start + rank
            pair_slot[p], slot_token[slot], slot_weight[slot] = slot, p // experts.shape[1], flat_w[p]
        run = -(-len(mine) // block_rows) * block_rows
        tile_expert += [e] * (run // block_rows)
        start += run
    return slot_token, slot_weight, pair_slot.reshape(experts.shape), tile_expert


@pytest.mark.parametrize("method", ["compare", "sort"])
@pytest.mark.parametrize("tokens,k,num_experts,block_rows", [(1, 8, 128, 16), (37, 4, 16, 16), (300, 2, 8, 64)])
def test_routing_layout_matches_its_definition(method, tokens, k, num_experts, block_rows):
    rng = np.random.default_rng(tokens * k + num_experts)
    experts = rng.integers(-1, num_experts + 2, size=(tokens, k))  # -1 and ids past the end: another device's
    weights = rng.random((tokens, k)).astype(np.float32)
    tiles = expert_tiles(jnp.asarray(experts), jnp.asarray(weights), num_experts, block_rows, method=method)
    slot_token, slot_weight, pair_slot, tile_expert = numpy_layout(experts, weights, num_experts, block_rows)
    assert np.array_equal(np.asarray(tiles.slot_token), slot_token)
    assert np.array_equal(np.asarray(tiles.slot_weight), slot_weight)
    assert np.array_equal(np.asarray(tiles.pair_slot), pair_slot)
    used = int(tiles.num_tiles[0])
    assert used == len(tile_expert) and np.array_equal(np.asarray(tiles.tile_expert)[:used], tile_expert)


@pytest.mark.parametrize("tokens,num_experts,k,normalize", [(1, 128, 8, True), (37, 60, 4, False), (20, 6, 6, True),
                                                            (16, 8, 2, True)])
def test_fused_top_k_routing_matches_float64(tokens, num_experts, k, normalize):
    """The router's softmax, top-k and renormalisation in one launch: the ids of a float64 softmax's k largest
    (ties broken towards the lower id, as lax.top_k does) and their weights; rows past a 16-row block too."""
    from pallas_kernels.grouped_matmul.router import top_k_routing

    rng = np.random.default_rng(SEED + tokens)
    logits = rng.standard_normal((tokens, num_experts)).astype(np.float32)
    logits[0, :4] = logits[0, 4]  # a five-way tie in the first row
    weights, ids = top_k_routing(jnp.asarray(logits), k, normalize, interpret=True)
    probs = np.exp(logits.astype(np.float64) - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    want_ids = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    want = np.take_along_axis(probs, want_ids, 1)
    if normalize:
        want /= want.sum(1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights, np.float64), want, rtol=1e-5, atol=1e-7)


def test_fused_router_rounds_its_weights_once_to_the_activations_dtype():
    """bf16 weights straight from the router are its float32 weights rounded once (to nearest), as the
    `astype` they replace would give; the ids are the same."""
    from pallas_kernels.grouped_matmul.router import top_k_routing

    logits = jnp.asarray(np.random.default_rng(SEED + 5).standard_normal((16, 128)), jnp.float32)
    w32, ids32 = top_k_routing(logits, 8, True, interpret=True)
    w16, ids16 = top_k_routing(logits, 8, True, interpret=True, weights_dtype=jnp.bfloat16)
    assert w16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ids16), np.asarray(ids32))
    np.testing.assert_array_equal(np.asarray(w16.astype(jnp.float32)), np.asarray(w32.astype(jnp.bfloat16)
                                                                                   .astype(jnp.float32)))


@pytest.mark.parametrize("tokens,num_tokens,num_experts,k", [(16, 3, 128, 8), (16, 16, 60, 4), (5, 5, 6, 6),
                                                             (16, 0, 8, 2)])
def test_router_lists_the_experts_its_real_tokens_chose(tokens, num_tokens, num_experts, k):
    """The fused router with the bucket's real token count: padding rows routed nowhere (-1), and the distinct
    experts of the real rows' choices listed in id order (-1 after them) with their count, as numpy's top-k over
    a float64 softmax finds them."""
    from pallas_kernels.grouped_matmul.router import top_k_routing_listed

    rng = np.random.default_rng(SEED + tokens + num_tokens)
    logits = rng.standard_normal((tokens, num_experts)).astype(np.float32)
    weights, ids, chosen = top_k_routing_listed(jnp.asarray(logits), k, True, interpret=True,
                                                num_tokens=jnp.int32(num_tokens))
    probs = np.exp(logits.astype(np.float64) - logits.max(1, keepdims=True))
    want_ids = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.asarray(ids)[:num_tokens], want_ids[:num_tokens])
    assert (np.asarray(ids)[num_tokens:] == -1).all()
    distinct = np.unique(want_ids[:num_tokens])
    assert int(chosen.count[0]) == len(distinct)
    listed = np.asarray(chosen.ids)
    np.testing.assert_array_equal(listed[:len(distinct)], distinct)
    assert (listed[len(distinct):] == -1).all()


@pytest.mark.parametrize("tokens,k,d,dtype", [(1, 8, 2048, jnp.bfloat16), (16, 8, 100, jnp.bfloat16),
                                               (37, 3, 64, jnp.float32)])
def test_by_token_combine_adds_each_tokens_choices_in_order(tokens, k, d, dtype):
    """The by-token layout's combine: row t is the float32 sum of rows t·k + c over the choices c of an expert in
    range, added left to right (so exactly numpy's float32 loop), then rounded once; rows of other devices' experts
    (or none) hold garbage that must not leak in; ragged token and column edges."""
    from pallas_kernels.grouped_matmul.combine import combine_pairs

    rng = np.random.default_rng(SEED + tokens)
    num_experts = 6
    experts = rng.integers(-2, num_experts + 2, (tokens, k)).astype(np.int32)
    pairs = rng.standard_normal((tokens * k, d)).astype(np.float32)
    pairs_in = np.asarray(jnp.asarray(pairs, dtype).astype(jnp.float32))  # as stored
    kept = (experts >= 0) & (experts < num_experts)
    want = np.zeros((tokens, d), np.float32)
    for t in range(tokens):
        for c in range(k):
            want[t] = want[t] + (pairs_in[t * k + c] if kept[t, c] else np.float32(0))
    got = combine_pairs(jnp.asarray(pairs, dtype), jnp.asarray(experts), num_experts, interpret=True)
    rounded = np.asarray(jnp.asarray(want).astype(dtype).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), rounded)
    # with the layer's residual add fused: the residual plus the rounded sum, in float32, rounded once
    residual = jnp.asarray(rng.standard_normal((tokens, d)) * 8, dtype)
    fused = combine_pairs(jnp.asarray(pairs, dtype), jnp.asarray(experts), num_experts, interpret=True,
                          residual=residual)
    want_fused = np.asarray(residual.astype(jnp.float32)) + rounded
    np.testing.assert_array_equal(np.asarray(fused.astype(jnp.float32)),
                                  np.asarray(jnp.asarray(want_fused).astype(dtype).astype(jnp.float32)))


@pytest.mark.parametrize("tokens,k,block_rows,dtype", [(1, 8, 16, jnp.bfloat16), (37, 3, 16, jnp.float32),
                                                      (256, 8, 32, jnp.bfloat16)])
def test_sorted_combine_matches_the_xla_gather_bit_for_bit(tokens, k, block_rows, dtype):
    """The sorted layout's combine against `routing.combine` (XLA's gather and left-to-right float32 sum) on a real
    slot layout, other devices' experts (no slot) included: the same bits; with the residual, the residual plus that
    rounded sum, rounded once."""
    from pallas_kernels.grouped_matmul.combine import combine_slots
    from pallas_kernels.grouped_matmul.routing import combine

    rng = np.random.default_rng(SEED + tokens)
    num_experts, d = 12, 200
    experts = np.stack([rng.choice(num_experts + 3, k, replace=False) for _ in range(tokens)]).astype(np.int32) - 2
    tiles = expert_tiles(jnp.asarray(experts), jnp.ones((tokens, k)), num_experts, block_rows)
    slots = jnp.asarray(rng.standard_normal((tiles.slot_token.shape[0], d)), dtype)
    want = combine(slots, tiles.pair_slot)
    got = combine_slots(slots, tiles.pair_slot, interpret=True)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    residual = jnp.asarray(rng.standard_normal((tokens, d)) * 8, dtype)
    fused = combine_slots(slots, tiles.pair_slot, interpret=True, residual=residual)
    want_fused = (residual.astype(jnp.float32) + want.astype(jnp.float32)).astype(dtype)
    np.testing.assert_array_equal(np.asarray(fused.astype(jnp.float32)), np.asarray(want_fused.astype(jnp.float32)))


@pytest.mark.parametrize("tokens", [1, 16, 64, 256, 512])
@pytest.mark.parametrize("workers_per_sm", [0, 2])
def test_lowers_for_h200(tokens, workers_per_sm):
    """Both grids lower through Triton at the Qwen3-30B-A3B layer shape, in each step size's layout (by token up to
    16 tokens, sorted above) and row tile (16, 32 and 64 rows): three launches, gate/up, down and the combine."""
    from pallas_kernels.grouped_matmul import tile_configs
    from tests.kernels.test_lowering import S, lower_for_h200

    configs = tuple(dataclasses.replace(c, workers_per_sm=workers_per_sm) for c in tile_configs(tokens * 8, 128))

    def call(x, gate, up, down, experts, routing):
        return moe_experts(x, ExpertWeights(gate, up, down), experts, routing, act=jax.nn.silu, configs=configs)

    bf16 = jnp.bfloat16
    text = lower_for_h200(call, S((tokens, 2048), bf16), S((128, 2048, 768), bf16), S((128, 2048, 768), bf16),
                          S((128, 768, 2048), bf16), S((tokens, 8), jnp.int32), S((tokens, 8), bf16))
    assert text.count("__gpu$xla.gpu.triton") == 3  # gate/up, down, the combine
