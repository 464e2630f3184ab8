"""`deterministic=True` under tensor parallelism (4 simulated CPU devices).

The batch-invariant projections multiply per device: a row-parallel weight's partial sums are added in device order
(each device sums its slice of the columns from every device's piece, left to right, and the slices are gathered),
never by an all-reduce whose order the collective library picks by message size. Checked on the matmul against
float64 numpy (1e-5 · max|ref|), against the left-to-right float32 sum of each device's slice computed alone
(bitwise), for a row alone and in a batch (bitwise), and on the compiled program (an all-to-all and an all-gather,
no all-reduce); then through `LLM`: greedy tokens the same alone, batched and chunked at TP = 2 (the chosen-token
logprobs within 1e-5, as at TP = 1), and within 1e-4 of one device's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from transformers import LlamaConfig, Qwen3MoeConfig

from jengine import LLM, SamplingParams
from jengine.layers.invariant import InvariantWeight, invariant_matmul
from jengine.parallel.mesh import TP_AXIS, build_mesh
from tests.conftest import COMMON, fresh_seed

SEED = fresh_seed()
DEVICES = 4
IMPLS = ["xla", "pallas_interpret"]


def placed(w: np.ndarray, impl: str, spec: P, transposed: bool = False) -> InvariantWeight:
    mesh = build_mesh(jax.devices()[:DEVICES])
    return InvariantWeight(jax.device_put(jnp.asarray(w), NamedSharding(mesh, spec)), transposed, impl, mesh, spec)


@pytest.mark.parametrize("n", [72, 70], ids=["columns-split-evenly", "uneven-columns"])
@pytest.mark.parametrize("impl", IMPLS)
def test_row_parallel_sums_the_devices_in_order(impl, n):
    rng = np.random.default_rng(SEED)
    tokens, k = 37, 96
    x = rng.normal(0, 1, (tokens, k)).astype(np.float32)
    w = rng.normal(0, 1, (k, n)).astype(np.float32)
    matmul = jax.jit(invariant_matmul)
    weight = placed(w, impl, P(TP_AXIS, None))
    ours = np.asarray(matmul(jnp.asarray(x), weight))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max(), f"seed {SEED}"
    # each device's slice alone (one device), then added from device 0 upward in float32
    width = k // DEVICES
    partials = [np.asarray(invariant_matmul(jnp.asarray(x[:, d * width:(d + 1) * width]),
                                            InvariantWeight(jnp.asarray(w[d * width:(d + 1) * width]), False, impl),
                                            out_dtype=jnp.float32)) for d in range(DEVICES)]
    in_order = partials[0]
    for partial in partials[1:]:
        in_order = in_order + partial
    assert np.array_equal(ours, in_order), f"the device partials were not added in device order (seed {SEED})"
    alone = np.asarray(matmul(jnp.asarray(x[5:6]), weight))
    assert np.array_equal(alone[0], ours[5]), f"a row alone differs from the same row in a batch (seed {SEED})"
    hlo = matmul.lower(jnp.asarray(x), weight).compile().as_text()
    assert "all-gather" in hlo and "all-reduce" not in hlo
    # columns that split evenly: each device sums its slice of them (an all-to-all), then the slices are gathered
    assert ("all-to-all" in hlo) == (n % DEVICES == 0)


@pytest.mark.parametrize("spec,transposed", [(P(None, TP_AXIS), False), (P(TP_AXIS, None), True), (P(), False)],
                         ids=["column-parallel", "vocab-parallel-head", "replicated"])
def test_split_outputs_equal_one_device_bitwise(spec, transposed):
    rng = np.random.default_rng(SEED + 1)
    x = rng.normal(0, 1, (19, 64)).astype(np.float32)
    w = rng.normal(0, 1, (80, 64) if transposed else (64, 80)).astype(np.float32)
    one = np.asarray(invariant_matmul(jnp.asarray(x), InvariantWeight(jnp.asarray(w), transposed, "pallas_interpret")))
    weight = placed(w, "pallas_interpret", spec, transposed)
    split = jax.jit(invariant_matmul)(jnp.asarray(x), weight)
    out_axis = spec[0] if transposed else spec[1] if len(spec) > 1 else None  # split as the weight's outputs are
    assert split.sharding.is_equivalent_to(NamedSharding(weight.mesh, P(None, out_axis)), 2)
    assert np.array_equal(np.asarray(split), one)


def run(model_dir, prompts, **engine_args):
    with LLM(str(model_dir), dtype="float32", max_model_len=64, seed=0, deterministic=True, **engine_args) as llm:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm._core.kv_manager.num_free_blocks == llm._core.kv_manager.num_blocks
        weights = llm._core.runner.params
    tokens = [o.outputs[0].token_ids for o in outputs]
    chosen = np.array([[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                       for o in outputs])
    return tokens, chosen, weights


@pytest.mark.parametrize("config,parallel", [
    (LlamaConfig(**COMMON), {}),
    (Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
     dict(enable_expert_parallel=True)),
], ids=["llama", "qwen3-moe-ep"])
def test_tp2_output_is_the_same_in_every_batch(build_checkpoint, tiny_tokenizer_dir, monkeypatch, config, parallel):
    # the Pallas kernels in interpret mode, each device's under shard_map, as on GPUs
    monkeypatch.setattr("jengine.layers.invariant.invariant_impl", lambda platform: "pallas_interpret")
    model_dir, _ = build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir)
    rng = np.random.default_rng(SEED)
    batch = [rng.integers(3, COMMON["vocab_size"], size=int(n)).tolist() for n in rng.integers(2, 30, size=3)]
    tp2 = dict(tensor_parallel_size=2, **parallel)
    tokens, logprobs, weights = run(model_dir, batch, max_num_seqs=8, **tp2)
    layer = weights["layers"][0]
    assert layer["wqkv"].spec == P(None, TP_AXIS) and layer["wo"].spec == P(TP_AXIS, None)  # column, row
    assert layer["wqkv"].mesh.size == 2 and weights["final_norm"].mesh.size == 2
    alone, alone_lp, _ = run(model_dir, batch[1:2], max_num_seqs=1, **tp2)
    assert alone == tokens[1:2] and np.abs(alone_lp - logprobs[1:2]).max() <= 1e-5, f"seed {SEED}"
    chunked, chunked_lp, _ = run(model_dir, batch, max_num_seqs=8, max_num_batched_tokens=8, **tp2)
    assert chunked == tokens and np.abs(chunked_lp - logprobs).max() <= 1e-5, f"seed {SEED}"
    one, one_lp, _ = run(model_dir, batch, max_num_seqs=8)
    assert one == tokens and np.abs(one_lp - logprobs).max() <= 1e-4, f"seed {SEED}"
