"""`LLM(..., data_parallel_size=2)`: two replicas on disjoint devices behind one core; the same greedy outputs as one
replica, requests with a shared system prompt kept on one replica (its prefix cache hits), others spread."""

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
