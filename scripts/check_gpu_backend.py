"""End-to-end check on the GPU: the engine with the `pallas_gpu` attention backend against the `reference` backend.

Builds a random-weight Llama checkpoint with head_dim 128 (GQA 4) on local disk, runs the same mixed-length greedy
batch through `LLM` with each backend (bfloat16), and compares the generated tokens and the chosen-token logprobs.
Writes a JSON summary to --out.

    PYTHONPATH=. python scripts/check_gpu_backend.py --out $OUT/gpu_backend_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jengine import LLM, SamplingParams  # noqa: E402
from jengine.models.demo import build_random_llama  # noqa: E402

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=128, max_position_embeddings=4096)


def run(model_dir: Path, backend: str, prompts: list[list[int]], max_tokens: int) -> tuple[list, float]:
    with LLM(str(model_dir), dtype="bfloat16", attention_backend=backend, max_model_len=2048, max_num_seqs=64,
             max_num_batched_tokens=2048, gpu_memory_utilization=0.5) as llm:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # compile
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return outputs, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(1, 1000, size=args.num_prompts)]
    model_dir = build_random_llama(Path(tempfile.mkdtemp()) / "llama-random", **SHAPE)
    ref, ref_s = run(model_dir, "reference", prompts, args.max_tokens)
    ours, ours_s = run(model_dir, "pallas_gpu", prompts, args.max_tokens)
    same_tokens, positions, max_lp_diff = 0, 0, 0.0
    first_divergence = []
    for r, o in zip(ref, ours, strict=True):
        rt, ot = r.outputs[0].token_ids, o.outputs[0].token_ids
        n = next((i for i, (a, b) in enumerate(zip(rt, ot)) if a != b), len(rt))
        first_divergence.append(n)
        same_tokens += n
        positions += len(rt)
        for i in range(n):  # logprobs compared where both saw the same tokens
            a, b = r.outputs[0].logprobs[i][rt[i]].logprob, o.outputs[0].logprobs[i][ot[i]].logprob
            max_lp_diff = max(max_lp_diff, abs(a - b))
    result = {
        "prompts": len(prompts), "max_tokens": args.max_tokens,
        "greedy_tokens_identical_fraction": same_tokens / positions,
        "requests_fully_identical": sum(d == args.max_tokens for d in first_divergence),
        "max_chosen_logprob_abs_diff": max_lp_diff,
        "reference_seconds": ref_s, "pallas_gpu_seconds": ours_s,
    }
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
