"""Tensor and expert parallelism on 8 simulated CPU devices, through `LLM` as a user runs it.

Every layout gives the greedy tokens of one device (float32) and chosen-token logprobs within 1e-4, and HF's greedy
tokens; the parameters and the KV cache are placed as the sharding rules say, checked on the placed arrays against
a table written here (not derived from the code under test). Prompts are fresh each run (seed in failures).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P
from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

from jengine import LLM, SamplingParams
from jengine.errors import ConfigError
from jengine.models.registry import spec_from_hf_config
from jengine.parallel.mesh import build_mesh, replica_devices
from jengine.parallel.sharding import plan_layout
from tests.conftest import COMMON, fresh_seed

MAX_TOKENS = 8
SEED = fresh_seed()
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(SEED)
    return [rng.integers(3, COMMON["vocab_size"], size=int(n)).tolist() for n in (1, 16, 37)]


def generate(model_dir, prompts, **parallel) -> tuple[list[list[int]], np.ndarray, LLM]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, **parallel)
    # min_tokens = max_tokens bans EOS throughout, as HF's min_new_tokens does (ignore_eos would lift the ban)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    core = llm._core
    assert not core.has_unfinished() and core.kv_manager.num_free_blocks == core.kv_manager.num_blocks
    tokens = [o.outputs[0].token_ids for o in outputs]
    chosen = np.array([[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                       for o in outputs])
    return tokens, chosen, llm


def hf_greedy(model, prompts) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def expected_specs(name: str, tp: int, ep: bool) -> P:
    """Megatron-style TP: column-parallel q/k/v, gate/up; row-parallel o, down; vocab-parallel embedding and head;
    experts split whole under EP, else each expert's hidden features split. One array per layer; experts stacked."""
    if tp == 1:
        return P()
    table = {
        "wqkv": P(None, "tp"), "bqkv": P("tp"), "wo": P("tp", None),
        "w_gate_up": P(None, "tp"), "w_down": P("tp", None),
        "ws_gate_up": P(None, "tp"), "ws_down": P("tp", None),  # a shared expert: split as the dense MLP
        "embed": P("tp", None), "lm_head": P("tp", None),
        "we_gate": P("tp", None, None) if ep else P(None, None, "tp"),
        "we_up": P("tp", None, None) if ep else P(None, None, "tp"),
        "we_down": P("tp", None, None) if ep else P(None, "tp", None),
    }
    return table.get(name, P())


def assert_placed_by_the_rules(llm: LLM, tp: int, ep: bool, num_kv_heads: int) -> None:
    runner = llm._core.runner
    leaves = {"embed": runner.params["embed"], **{f"{name}#{i}": leaf for i, seg in
                                                  enumerate(runner.params["layers"]) for name, leaf in seg.items()}}
    if "lm_head" in runner.params:
        leaves["lm_head"] = runner.params["lm_head"]
    for key, leaf in leaves.items():
        name = key.split("#")[0]
        want = expected_specs(name, tp, ep)
        assert len(leaf.sharding.device_set) == tp, key
        got = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
        assert got == tuple(want) + (None,) * (leaf.ndim - len(want)), (key, leaf.sharding.spec, want)
        shard = leaf.addressable_shards[0].data.shape
        split = [i for i, axis in enumerate(want) if axis == "tp"]
        assert shard == tuple(s // tp if i in split else s for i, s in enumerate(leaf.shape)), (key, shard)
    cache = runner.kv_cache
    kv_axis = 4  # [layers, blocks, block_size, 2, kv_heads, head_dim]; TP beyond the KV heads: one (copy) each
    assert cache.addressable_shards[0].data.shape[kv_axis] == max(num_kv_heads // tp, 1)
    assert len(cache.sharding.device_set) == tp


DENSE = {
    "llama": (lambda: LlamaConfig(**{**COMMON, "num_attention_heads": 8, "num_key_value_heads": 4}), (2, 4, 8)),
    "qwen2": (lambda: Qwen2Config(**COMMON, tie_word_embeddings=True), (2, 4)),
    "qwen3": (lambda: Qwen3Config(**COMMON, head_dim=32), (4,)),
}


@pytest.mark.parametrize("family", sorted(DENSE))
def test_tensor_parallel_matches_one_device(family, build_checkpoint, tiny_tokenizer_dir, prompts):
    make_config, sizes = DENSE[family]
    config = make_config()
    model_dir, hf_model = build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir)
    base_tokens, base_logprobs, llm = generate(model_dir, prompts)
    llm.shutdown()
    assert base_tokens == hf_greedy(hf_model, prompts), f"seed {SEED}"
    for tp in sizes:
        tokens, logprobs, llm = generate(model_dir, prompts, tensor_parallel_size=tp)
        assert_placed_by_the_rules(llm, tp, False, config.num_key_value_heads)
        llm.shutdown()
        assert tokens == base_tokens, f"TP={tp} changed greedy tokens (seed {SEED})"
        np.testing.assert_allclose(logprobs, base_logprobs, atol=LOGPROB_TOL, err_msg=f"TP={tp}, seed {SEED}")


MOE = {
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": lambda: Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 4}, moe_intermediate_size=32,
                                        num_experts=8, num_experts_per_tok=3, mlp_only_layers=[0]),
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                                        shared_expert_intermediate_size=48, mlp_only_layers=[1]),
}


@pytest.mark.parametrize("family", sorted(MOE))
def test_expert_parallel_matches_one_device(family, build_checkpoint, tiny_tokenizer_dir, prompts):
    config = MOE[family]()
    model_dir, _ = build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir)
    base_tokens, base_logprobs, llm = generate(model_dir, prompts)
    llm.shutdown()
    for tp, ep in ((2, True), (4, True), (2, False)):
        tokens, logprobs, llm = generate(model_dir, prompts, tensor_parallel_size=tp, enable_expert_parallel=ep)
        assert_placed_by_the_rules(llm, tp, ep, config.num_key_value_heads)
        llm.shutdown()
        assert tokens == base_tokens, f"TP={tp} EP={ep} changed greedy tokens (seed {SEED})"
        np.testing.assert_allclose(logprobs, base_logprobs, atol=LOGPROB_TOL, err_msg=f"TP={tp} EP={ep}, {SEED}")


def _spec(**overrides):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **COMMON, **overrides}
    return spec_from_hf_config(config)


def test_impossible_layouts_are_refused_clearly():
    with pytest.raises(ConfigError, match="does not divide the 4 query heads"):
        plan_layout(_spec(), build_mesh(replica_devices(3)))
    with pytest.raises(ConfigError, match="needs 16 devices, but only 8"):
        replica_devices(16)
    with pytest.raises(ConfigError, match="needs 8 devices"):
        replica_devices(4, data_parallel_size=2, devices=replica_devices(4))
    with pytest.raises(ConfigError, match="intermediate_size=90"):
        plan_layout(_spec(intermediate_size=90), build_mesh(replica_devices(4)))
    moe = spec_from_hf_config({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **COMMON,
                               "num_local_experts": 6, "num_experts_per_tok": 2})
    with pytest.raises(ConfigError, match="does not divide the 6 experts"):
        plan_layout(moe, build_mesh(replica_devices(4)), expert_parallel=True)
    shared = spec_from_hf_config({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **COMMON,
                                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                  "shared_expert_intermediate_size": 90})
    for expert_parallel in (False, True):
        with pytest.raises(ConfigError, match="does not divide the shared expert's intermediate size 90"):
            plan_layout(shared, build_mesh(replica_devices(4)), expert_parallel=expert_parallel)


def test_kv_heads_repeat_when_tp_exceeds_them():
    layout = plan_layout(_spec(num_attention_heads=8, num_key_value_heads=2), build_mesh(replica_devices(8)))
    assert layout.kv_head_repeat == 4
    assert plan_layout(_spec(), build_mesh(replica_devices(2))).kv_head_repeat == 1


def test_more_devices_than_present_fails_at_engine_start(build_checkpoint, tiny_tokenizer_dir):
    model_dir, _ = build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=tiny_tokenizer_dir)
    with pytest.raises(ConfigError, match="only 8"):
        LLM(str(model_dir), tensor_parallel_size=16)


def compiled_collectives(llm: LLM) -> set[str]:
    """The collective ops in the compiled forward step of this engine (a decode of two requests)."""
    from jengine.attention.metadata import build_metadata
    from jengine.runner.step import ModelInputs, StepModel, forward_step

    runner = llm._core.runner
    md = build_metadata([1, 1], [5, 9], [[0], [1]], block_size=16, num_slots=runner.kv_cache.shape[1] * 16,
                        num_tokens_padded=8, num_seqs_padded=2, blocks_per_seq_padded=2)
    ep = runner.layout.mesh if runner.layout.expert_parallel else None
    inputs = ModelInputs(np.zeros(8, np.int32), md, np.array([0, 1], np.int32), None, None)
    lowered = forward_step.lower(StepModel(runner.spec, runner.backend, ep), runner.params, runner.state, inputs)
    text = lowered.compile().as_text()
    return {op for op in ("all-gather", "all-to-all", "reduce-scatter", "all-reduce") if f" {op}(" in text}


@pytest.mark.parametrize("config, parallel", [
    (lambda: LlamaConfig(**{**COMMON, "num_attention_heads": 8, "num_key_value_heads": 4}),
     dict(tensor_parallel_size=4)),
    (MOE["mixtral"], dict(tensor_parallel_size=4, enable_expert_parallel=True)),
])
def test_step_only_all_reduces(config, parallel, build_checkpoint, tiny_tokenizer_dir):
    """The sharded step never gathers weights or the KV cache: its only collectives are the all-reduces of the
    row-parallel projections, the vocab-parallel embedding and the expert combine."""
    model_dir, _ = build_checkpoint(config(), tokenizer_dir=tiny_tokenizer_dir)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, **parallel)
    try:
        assert compiled_collectives(llm) == {"all-reduce"}
    finally:
        llm.shutdown()
