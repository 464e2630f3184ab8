"""Speculation never changes greedy output: tokens equal the plain engine's exactly (float32, CPU), for each
proposer (n-gram, draft model, random EAGLE and EAGLE-3 heads in the published layouts), on dense and MoE targets,
alone and batched, with a small token budget (chunked prefill) and a KV pool small enough to force preemption;
nothing leaks and rejected drafts' blocks come back."""

from __future__ import annotations

import numpy as np
import pytest

from jengine import LLM, SamplingParams
from tests.conftest import COMMON, fresh_seed

SEED = fresh_seed()
MAX_TOKENS = 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def draft_config(draft_dir) -> dict:
    return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Four 30-token prompts that fill an 8-block pool (each needs a third block at its 33rd token), prompts with
    repeated segments (n-gram matches), and one sharing a full block with the first."""
    rng = np.random.default_rng(SEED)
    vocab = COMMON["vocab_size"]
    fill_pool = [rng.integers(3, vocab, size=30).tolist() for _ in range(4)]
    segment = rng.integers(3, vocab, size=7).tolist()
    repeating = [segment * 3, segment * 2 + rng.integers(3, vocab, size=5).tolist(), segment[:3] * 4]
    shared_block = fill_pool[0][:20] + segment[:4]  # its first 16 tokens are another prompt's: a prefix-cache hit
    return fill_pool + repeating + [shared_block]


def generate(model_dir, prompts, **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, seed=0, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    core = llm._core
    assert not core.has_unfinished()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks
    core.kv_manager.check_invariants()
    return [o.outputs[0].token_ids for o in outputs], llm


VARIANTS = {
    "batched": dict(max_num_seqs=8),
    "token budget 64 and a small pool (chunked prefill, preemption)": dict(
        max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=8, block_size=16),
}


@pytest.fixture(scope="module")
def plain_outputs(request, prompts) -> dict[str, list[list[int]]]:
    """Each family's greedy tokens without speculation (batched: the engine's invariance tests show it equals
    alone), computed once."""
    cache: dict[str, list[list[int]]] = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            tokens, llm = generate(request.getfixturevalue(f"{family}_target"), prompts, max_num_seqs=8)
            llm.shutdown()
            cache[family] = tokens
        return cache[family]

    return get


def speculative_config(method: str, family: str, small_draft, eagle_heads) -> dict:
    if method == "ngram":
        return NGRAM
    if method == "draft_model":
        return draft_config(small_draft)
    return {"method": method, "model": str(eagle_heads[method, family]), "num_speculative_tokens": 3}


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
@pytest.mark.parametrize("family", ["dense", "moe"])
def test_greedy_output_identical_with_speculation(family, method, request, prompts, small_draft, eagle_heads,
                                                  plain_outputs):
    target = request.getfixturevalue(f"{family}_target")
    speculative = speculative_config(method, family, small_draft, eagle_heads)
    plain = plain_outputs(family)
    variants = VARIANTS if family == "moe" else {"alone": dict(max_num_seqs=1), **VARIANTS}
    for name, engine_args in variants.items():
        tokens, llm = generate(target, prompts, speculative_config=speculative, **engine_args)
        assert tokens == plain, f"{method} on {family}, {name}: greedy output changed (seed {SEED})"
        core = llm._core
        assert core.scheduler.spec_counts.num_draft_tokens > 0, "nothing was speculated"
        if "preemption" in name:
            assert core.scheduler.num_preemptions_total > 0, "the small pool should force preemptions"
        if name == "batched":
            assert core.kv_manager.prefix_cache_stats.hits > 0, "the shared block should hit the prefix cache"
        llm.shutdown()


def test_self_draft_accepts_everything(dense_target, prompts):
    """The target as its own draft proposes exactly its greedy tokens: every draft is accepted."""
    tokens, llm = generate(dense_target, prompts[4:], max_num_seqs=4, speculative_config=draft_config(dense_target))
    counts = llm._core.scheduler.spec_counts
    assert counts.num_draft_tokens > 0 and counts.num_accepted_tokens == counts.num_draft_tokens
    llm.shutdown()
