"""`deterministic=True` (`--deterministic`): the projections, MoE router and LM head run the batch-invariant matmul,
the norms and log-softmaxes the batch-invariant row reductions (`layers/invariant.py`; here the Pallas kernels in
interpret mode, as on a GPU), and a request's greedy tokens are the same alone, batched and chunked. In float32 its
logprobs are within 1e-5 (the CPU reference attention reduces over the step's padded block-table width, so its last
bits follow the batch; the GPU check, `scripts/check_determinism_gpu.py`, asks for bitwise equality) and within 1e-4
of the default engine's. In bfloat16 the same last bits can, rarely, round a hidden state to the neighbouring bfloat16
value and the logprobs after it move by up to a few 1e-3 (seed 3543638078: 8.5e-3 from the third token on, tokens
the same): tokens identical, logprobs within 2e-2. Combinations it does not take are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import LlamaConfig, Qwen3MoeConfig

from jengine import LLM, SamplingParams
from jengine.cli import build_parser, engine_kwargs
from jengine.errors import ConfigError
from jengine.layers.invariant import InvariantNorm, InvariantWeight
from tests.conftest import COMMON, fresh_seed

SEED = fresh_seed()
MAX_TOKENS = 6
BF16_LOGPROB_TOL = 2e-2  # see the module docstring


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    monkeypatch.setattr("jengine.layers.invariant.invariant_impl", lambda platform: "pallas_interpret")


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(SEED)
    return [rng.integers(3, COMMON["vocab_size"], size=int(n)).tolist() for n in rng.integers(2, 30, size=3)]


def run(model_dir, prompts, dtype="float32", **engine_args):
    with LLM(str(model_dir), dtype=dtype, max_model_len=64, seed=0, **engine_args) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        weights = llm._core.runner.params
        assert llm._core.kv_manager.num_free_blocks == llm._core.kv_manager.num_blocks
    tokens = [o.outputs[0].token_ids for o in outputs]
    chosen = np.array([[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                       for o in outputs])
    return tokens, chosen, weights


@pytest.mark.parametrize("config", [
    LlamaConfig(**COMMON, tie_word_embeddings=True),
    Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
], ids=["llama-tied", "qwen3-moe"])
def test_deterministic_output_is_the_same_in_every_batch(build_checkpoint, tiny_tokenizer_dir, kernel_on_cpu,
                                                         config):
    model_dir, _ = build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir)
    batch = prompts()
    tokens, logprobs, weights = run(model_dir, batch, deterministic=True, max_num_seqs=8)
    layer = weights["layers"][0]
    assert isinstance(weights["lm_head"], InvariantWeight) and isinstance(layer["wqkv"], InvariantWeight)
    assert isinstance(weights["final_norm"], InvariantNorm) and isinstance(layer["mlp_norm"], InvariantNorm)
    assert any(isinstance(leaf, InvariantWeight) and name == "router" for name, leaf in layer.items()) == (
        "router" in layer)
    for i, prompt in enumerate(batch):
        alone, alone_lp, _ = run(model_dir, [prompt], deterministic=True, max_num_seqs=1)
        assert alone == [tokens[i]], f"request {i} alone differs from the batch (seed {SEED})"
        assert np.abs(alone_lp[0] - logprobs[i]).max() <= 1e-5
    chunked, chunked_lp, _ = run(model_dir, batch, deterministic=True, max_num_seqs=8, max_num_batched_tokens=8)
    assert chunked == tokens and np.abs(chunked_lp - logprobs).max() <= 1e-5
    fast, fast_lp, _ = run(model_dir, batch, max_num_seqs=8)
    assert fast == tokens and np.abs(fast_lp - logprobs).max() <= 1e-4


@pytest.mark.parametrize("engine_args,named", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative decoding"),
    (dict(enable_lora=True), "LoRA"),
    (dict(quantization="fp8"), "float checkpoints"),
])
def test_combinations_it_does_not_take_are_refused(build_checkpoint, tiny_tokenizer_dir, engine_args, named):
    model_dir, _ = build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=tiny_tokenizer_dir)
    with pytest.raises(ConfigError, match=named):
        LLM(str(model_dir), deterministic=True, **engine_args)


def test_the_cli_flag():
    for flags, value in (([], None), (["--deterministic"], True), (["--no-deterministic"], False)):
        args = build_parser().parse_args(["serve", "--model", "MODEL", *flags])
        assert engine_kwargs(args).get("deterministic") is value


LLAMA_64 = LlamaConfig(**COMMON, head_dim=64)  # a head_dim the Pallas attention serves (64, 128)
NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize("config,engine_args,dtype,platform,blocked_by", [
    pytest.param(LLAMA_64, {}, "bfloat16", "gpu", None, id="gpu"),
    pytest.param(LLAMA_64, {}, "float16", "gpu", None, id="gpu-fp16"),
    pytest.param(LlamaConfig(**COMMON), {}, "bfloat16", "gpu", "attention kernels", id="head-dim-16"),
    pytest.param(LLAMA_64, {}, "bfloat16", "cpu", "cpu", id="cpu"),
    pytest.param(LLAMA_64, {}, "float32", "gpu", "float32", id="fp32"),
    pytest.param(LLAMA_64, dict(attention_backend="reference"), "bfloat16", "gpu", "attention kernels",
                 id="reference-attention"),
    pytest.param(LLAMA_64, dict(block_size=8), "bfloat16", "gpu", "attention kernels", id="block-size-8"),
    pytest.param(LLAMA_64, dict(enable_lora=True), "bfloat16", "gpu", "LoRA", id="lora"),
    pytest.param(LLAMA_64, dict(quantization="fp8"), "bfloat16", "gpu", "quantized", id="quantized"),
    pytest.param(LLAMA_64, dict(speculative_config=NGRAM), "bfloat16", "gpu", "speculative", id="speculative"),
    pytest.param(Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=64),
                 {}, "bfloat16", "gpu", "MoE", id="moe"),
])
def test_the_default_turns_it_on_only_where_its_cost_was_measured(build_checkpoint, tiny_tokenizer_dir, config,
                                                                  engine_args, dtype, platform, blocked_by):
    """`deterministic=None` (the default): on for a dense 16-bit float model on one GPU, off elsewhere with the
    reason named; asked for explicitly, it is what was asked."""
    import jax
    import jax.numpy as jnp

    from jengine.config import EngineConfig
    from jengine.factory import auto_deterministic_blocker, resolve_deterministic
    from jengine.models.loader import load_spec
    from jengine.parallel.mesh import build_mesh
    from jengine.parallel.sharding import plan_layout

    model_dir, _ = build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir)
    engine = EngineConfig.from_kwargs(str(model_dir), **engine_args)
    spec = load_spec(str(model_dir))
    layout = plan_layout(spec, build_mesh(jax.devices()[:1]), False)
    blocker = auto_deterministic_blocker(engine, spec, {"layers": ()}, layout, jnp.dtype(dtype), platform)
    assert (blocker is None) if blocked_by is None else (blocked_by in blocker)
    assert resolve_deterministic(engine, spec, {"layers": ()}, layout, jnp.dtype(dtype), platform) == (
        blocked_by is None)
    for asked in (True, False):
        explicit = EngineConfig.from_kwargs(str(model_dir), deterministic=asked)
        assert resolve_deterministic(explicit, spec, {"layers": ()}, layout, jnp.dtype(dtype), platform) is asked


def test_the_default_engine_on_the_cpu_keeps_plain_weights(build_checkpoint, tiny_tokenizer_dir):
    model_dir, _ = build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=tiny_tokenizer_dir)
    _, _, weights = run(model_dir, prompts()[:1])
    assert not isinstance(weights["lm_head"], InvariantWeight)


def test_bfloat16_output_is_the_same_in_every_batch(build_checkpoint, tiny_tokenizer_dir, kernel_on_cpu):
    """In bfloat16 (the dtype a GPU serves), tokens the same alone, batched and chunked; chosen-token logprobs
    within bfloat16's rounding of the CPU attention's last bits (see the module docstring)."""
    model_dir, _ = build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=tiny_tokenizer_dir)
    batch = prompts()
    tokens, logprobs, _ = run(model_dir, batch, dtype="bfloat16", deterministic=True, max_num_seqs=8)
    chunked, chunked_lp, _ = run(model_dir, batch, dtype="bfloat16", deterministic=True, max_num_seqs=8,
                                 max_num_batched_tokens=8)
    assert chunked == tokens and np.abs(chunked_lp - logprobs).max() <= BF16_LOGPROB_TOL, f"chunked (seed {SEED})"
    for i, prompt in enumerate(batch):
        alone, alone_lp, _ = run(model_dir, [prompt], dtype="bfloat16", deterministic=True, max_num_seqs=1)
        assert alone == [tokens[i]], f"request {i} (seed {SEED})"
        assert np.abs(alone_lp[0] - logprobs[i]).max() <= BF16_LOGPROB_TOL, f"request {i} (seed {SEED})"
