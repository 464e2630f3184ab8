"""`LLM(..., data_parallel_size=2)`: two replicas on disjoint devices behind one core; the same greedy outputs as one
replica, requests with a shared system prompt kept on one replica (its prefix cache hits), others spread, and a
short header every prompt shares (a chat template's) does not pull them all onto one replica."""

from __future__ import annotations

import numpy as np
from transformers import LlamaConfig

from jengine import LLM, SamplingParams
from tests.conftest import COMMON

BLOCK = 16


def test_two_replicas_answer_like_one(build_checkpoint, tiny_tokenizer_dir):
    model_dir, _ = build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=tiny_tokenizer_dir)
    rng = np.random.default_rng()
    system = rng.integers(3, COMMON["vocab_size"], size=3 * BLOCK).tolist()
    shared = [system + rng.integers(3, COMMON["vocab_size"], size=5).tolist() for _ in range(4)]
    own = [rng.integers(3, COMMON["vocab_size"], size=int(n)).tolist() for n in (7, 20, 33, 9)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kwargs = dict(dtype="float32", max_model_len=128, block_size=BLOCK, max_num_seqs=4)

    with LLM(str(model_dir), **kwargs) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(
            [{"prompt_token_ids": p} for p in shared + own], params, use_tqdm=False)]

    with LLM(str(model_dir), data_parallel_size=2, **kwargs) as two:
        cores = two._core.cores
        assert len(cores) == 2
        devices = [c.runner.kv_cache.sharding.device_set for c in cores]
        assert not devices[0] & devices[1], "replicas must sit on disjoint devices"
        first = two.generate([{"prompt_token_ids": shared[0]}], params, use_tqdm=False)  # the prefix lands first
        rest = two.generate([{"prompt_token_ids": p} for p in shared[1:] + own], params, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in first + rest]
        assert got == expected
        hits = [c.kv_manager.prefix_cache_stats.hits for c in cores]
        assert sorted(hits)[0] == 0 and max(hits) >= 3 * (3 * BLOCK - 1), hits  # one replica served the prefix
        steps = [c.num_steps for c in cores]
        assert min(steps) > 0, f"load did not spread: {steps}"
        for core in cores:
            assert not core.has_unfinished()
            assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def _counting_adds(core) -> list[str]:
    """The ids of the requests added to `core` from now on (test instrumentation: shadows its bound method)."""
    added: list[str] = []
    add = core.add_request

    def counting(request, *args, **kwargs):
        added.append(request.request_id)
        return add(request, *args, **kwargs)

    core.add_request = counting
    return added


def test_a_shared_header_spreads_and_long_system_prompts_stay_where_cached(build_checkpoint, tiny_tokenizer_dir):
    """200 prompts that share only ~40 leading tokens (a chat template's header and a short system line), 16 in
    flight: both replicas serve at least 35 %. Two long system prompts (over 1,024 tokens): each replica keeps one,
    and every later request hits its prefix cache."""
    model_dir, _ = build_checkpoint(LlamaConfig(**{**COMMON, "max_position_embeddings": 1152}),
                                    tokenizer_dir=tiny_tokenizer_dir)
    rng = np.random.default_rng(0)
    vocab = COMMON["vocab_size"]
    header = rng.integers(3, vocab, size=40).tolist()
    chats = [header + [3 + i % (vocab - 3)] + rng.integers(3, vocab, size=9).tolist() for i in range(200)]
    systems = [rng.integers(3, vocab, size=65 * BLOCK).tolist() for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=1)
    kwargs = dict(dtype="float32", max_model_len=1152, block_size=BLOCK, max_num_seqs=8, max_num_queued_reqs=8,
                  max_num_batched_tokens=512, compile_buckets="all")  # 8 + 8: 16 requests in flight

    with LLM(str(model_dir), data_parallel_size=2, **kwargs) as two:
        cores = two._core.cores
        added = [_counting_adds(core) for core in cores]
        two.generate([{"prompt_token_ids": p} for p in chats], params, use_tqdm=False)
        served = [len(ids) for ids in added]
        assert sum(served) == len(chats) and min(served) >= 0.35 * len(chats), served

        long = [[system + rng.integers(3, vocab, size=5).tolist() for _ in range(3)] for system in systems]
        hits_before = [c.kv_manager.prefix_cache_stats.hits for c in cores]
        for first in (long[0][0], long[1][0]):  # each computed (and cached) once, on the replica chosen for it
            two.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
        counts_before = [len(ids) for ids in added]
        two.generate([{"prompt_token_ids": p} for p in (long[0][1], long[1][1], long[0][2], long[1][2])], params,
                     use_tqdm=False)  # added at once: loads within the bound
        hits = [c.kv_manager.prefix_cache_stats.hits - b for c, b in zip(cores, hits_before)]
        assert [len(ids) - n for ids, n in zip(added, counts_before)] == [2, 2]
        assert min(hits) >= 2 * 65 * BLOCK, hits  # every later request found its system prompt cached
        for core in cores:
            assert not core.has_unfinished()
            assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks
