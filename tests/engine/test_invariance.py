"""The engine's promise, on a real tiny model through `LLM`: a request's greedy tokens do not depend on what else
runs with it, on chunked prefill, on prefix caching, or on preemption; and they equal HF transformers'.

Prompts are drawn fresh each run (the seed is in every failure message). Every test ends by checking that nothing
leaked: no request left in the engine and every KV block free.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from jengine import LLM, SamplingParams
from tests.conftest import COMMON, fresh_seed

MAX_TOKENS = 12
SEED = fresh_seed()


@pytest.fixture(scope="module")
def tiny_model(build_checkpoint, tiny_tokenizer_dir):
    config = LlamaConfig(**{**COMMON, "max_position_embeddings": 256})
    return build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(SEED)
    system = rng.integers(3, COMMON["vocab_size"], size=24).tolist()  # a shared prefix: prefix-cache hits
    lengths = rng.integers(1, 40, size=6)
    own = [rng.integers(3, COMMON["vocab_size"], size=int(n)).tolist() for n in lengths]
    # Four 30-token prompts first: with an 8-block pool they take every block, and each needs a third block at its
    # 33rd token, so the small-pool run must preempt.
    fill_pool = [rng.integers(3, COMMON["vocab_size"], size=30).tolist() for _ in range(4)]
    return fill_pool + [system + p for p in own[:3]] + own[3:] + [system[:16]]  # last: a block-aligned full prefix


def run(model_dir, prompts, **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, seed=0, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_nothing_leaked(llm)
    return [o.outputs[0].token_ids for o in outputs], llm


def assert_nothing_leaked(llm: LLM) -> None:
    core = llm._core
    assert not core.has_unfinished()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks
    core.kv_manager.check_invariants()


def test_greedy_output_is_invariant(tiny_model, prompts):
    model_dir, _ = tiny_model
    alone = []
    for prompt in prompts:
        tokens, llm = run(model_dir, [prompt], max_num_seqs=1)
        alone += tokens
        llm.shutdown()
    variants = {
        "full batch": dict(max_num_seqs=8),
        "tiny token budget (chunked prefill)": dict(max_num_seqs=8, max_num_batched_tokens=5),
        "prefix caching off": dict(max_num_seqs=8, enable_prefix_caching=False),
        "small KV pool (preemption)": dict(max_num_seqs=8, num_gpu_blocks_override=8, block_size=16),
    }
    for name, engine_args in variants.items():
        tokens, llm = run(model_dir, prompts, **engine_args)
        assert tokens == alone, f"{name} changed greedy output (seed {SEED})"
        if "preemption" in name:
            assert llm._core.scheduler.num_preemptions_total > 0, "the small pool should force preemptions"
        if name == "full batch":
            assert llm._core.kv_manager.prefix_cache_stats.hits > 0, "shared prefixes should hit the cache"
        llm.shutdown()


def test_generate_matches_transformers_with_logprobs(tiny_model, prompts):
    """Greedy tokens equal HF `generate`; the top-5 raw logprobs and prompt logprobs match HF within 1e-3."""
    model_dir, hf_model = tiny_model
    with LLM(str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=4) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=5,
                                prompt_logprobs=3)  # min_tokens = max_tokens: EOS banned, as HF's min_new_tokens
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
        assert_nothing_leaked(llm)
    for prompt, out in zip(prompts[:4], outputs, strict=True):
        choice = out.outputs[0]
        with torch.no_grad():
            hf = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                   do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            full = prompt + choice.token_ids
            ref = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].double(), -1).numpy()
        assert choice.token_ids == hf[0, len(prompt):].tolist(), f"seed {SEED}"
        for step, entries in enumerate(choice.logprobs):
            row = ref[len(prompt) - 1 + step]
            assert len(entries) >= 5
            for token_id, logprob in entries.items():
                assert abs(logprob.logprob - row[token_id]) <= 1e-3
            top5 = set(np.argsort(-row)[:5].tolist())
            assert top5 <= set(entries), "the top-5 tokens must be reported"
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            entries = out.prompt_logprobs[position]
            assert abs(entries[prompt[position]].logprob - ref[position - 1][prompt[position]]) <= 1e-3


def test_reset_prefix_cache_makes_the_next_prompt_compute_in_full(tiny_model, prompts):
    """A repeated prompt hits the cache; after reset_prefix_cache it is computed in full, to the same output."""
    model_dir, _ = tiny_model
    prompt = {"prompt_token_ids": prompts[0]}  # 30 tokens: one full 16-token block to cache
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(model_dir), dtype="float32", max_model_len=128) as llm:
        first, again = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
        assert again.num_cached_tokens >= 16 and first.num_cached_tokens == 0
        assert llm.reset_prefix_cache()
        after = llm.generate(prompt, params, use_tqdm=False)[0]
        assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == first.outputs[0].token_ids
