"""Each adapter's output equals HF transformers with that PEFT adapter merged (`merge_and_unload`): float32
chosen-token logprobs within 2e-3 and identical greedy tokens; a mixed batch of adapters and the base model equals
each request alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jengine import LLM, LoRARequest, SamplingParams
from tests.conftest import COMMON, fresh_seed
from tests.engine.test_invariance import assert_nothing_leaked

SEED = fresh_seed()
NEW_TOKENS = 10
LOGPROB_TOL = 2e-3
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(SEED)
    return [rng.integers(3, COMMON["vocab_size"], size=int(n)).tolist() for n in (5, 17, 30)]


@pytest.fixture(scope="module")
def adapters(make_adapter):
    """Four adapters: ranks 8, 4, 16 and 2; all seven projections, q and v only, rsLoRA, the MLP only."""
    return [make_adapter(8, seed=1),
            make_adapter(4, modules=("q_proj", "v_proj"), seed=2),
            make_adapter(16, rslora=True, alpha=8, seed=3),
            make_adapter(2, modules=("gate_proj", "up_proj", "down_proj"), seed=4)]


def _chosen_logprobs(model, prompt: list[int], generated: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The reference's logprobs of `generated` (teacher-forced) and its best logprob at each position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated[:-1]])).logits[0].double()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:], -1)
    return logprobs[torch.arange(len(generated)), torch.tensor(generated)].numpy(), logprobs.max(-1).values.numpy()


def _check_against(reference, prompt: list[int], output) -> None:
    """Each generated token is the reference's greedy choice given the same prefix (teacher-forced, so a position
    is judged on its own), or within LOGPROB_TOL of it: two tokens that close are a tie that float32 rounding may
    break either way. The chosen tokens' logprobs agree within LOGPROB_TOL."""
    tokens = list(output.token_ids)
    ref_logprobs, ref_best = _chosen_logprobs(reference, prompt, tokens)
    ours = np.array([entry[token].logprob for entry, token in zip(output.logprobs, tokens)])
    behind = ref_best - ref_logprobs
    assert behind.max() <= LOGPROB_TOL, f"seed {SEED}: a token the merged model ranks {behind.max():.2e} below its best"
    assert np.abs(ours - ref_logprobs).max() <= LOGPROB_TOL, f"seed {SEED}"


def _requests(adapters) -> list[LoRARequest]:
    return [LoRARequest(f"adapter{i}", i + 1, str(path)) for i, (path, _) in enumerate(adapters)]


def test_each_adapter_equals_peft_merged(lora_base, adapters, prompts):
    model_dir, base = lora_base
    with LLM(str(model_dir), dtype="float32", max_model_len=128, enable_lora=True, max_loras=2,
             max_lora_rank=16) as llm:
        for request, (_, merged) in zip(_requests(adapters), adapters):
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False,
                                   lora_request=request)
            for prompt, output in zip(prompts, outputs):
                _check_against(merged, prompt, output.outputs[0])
        base_outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        for prompt, output in zip(prompts, base_outputs):
            _check_against(base, prompt, output.outputs[0])
        assert_nothing_leaked(llm)


def test_mixed_batch_equals_each_alone(lora_base, adapters, prompts):
    """Four adapters of different ranks and the base model in one batch (max_loras=4: all in one step), each
    prompt under each; equal to the request run alone."""
    model_dir, _ = lora_base
    requests = _requests(adapters) + [None]
    pairs = [(p, r) for p in prompts for r in requests]
    plain = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), dtype="float32", max_model_len=128, enable_lora=True, max_loras=4,
             max_lora_rank=16) as llm:
        mixed = llm.generate([{"prompt_token_ids": p} for p, _ in pairs], plain, use_tqdm=False,
                             lora_request=[r for _, r in pairs])
        alone = [llm.generate({"prompt_token_ids": p}, plain, use_tqdm=False, lora_request=r)[0]
                 for p, r in pairs]
        assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone], f"seed {SEED}"
        by_adapter = {str(r): o.outputs[0].token_ids for (p, r), o in zip(pairs, mixed) if p is prompts[-1]}
        assert len(set(map(tuple, by_adapter.values()))) == len(requests), "every adapter changes the output"
        assert_nothing_leaked(llm)


def test_loading_into_a_slot_never_compiles(lora_base, adapters, prompts):
    """After one adapter has run a shape, others loaded into the slots run it with no new program."""
    from jengine.lora.device import _write_slot
    from jengine.runner.step import num_compiled_shapes

    model_dir, _ = lora_base
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(str(model_dir), dtype="float32", max_model_len=128, enable_lora=True, max_loras=1,
             max_lora_rank=16) as llm:
        first, *others = _requests(adapters)
        for _ in range(2):  # the second call meets the steps that follow a finished call too
            llm.generate({"prompt_token_ids": prompts[0]}, plain, use_tqdm=False, lora_request=first)
        compiled, writes = num_compiled_shapes(), _write_slot._cache_size()
        for request in others:  # one slot: each loads over the one before
            llm.generate({"prompt_token_ids": prompts[0]}, plain, use_tqdm=False, lora_request=request)
        assert (num_compiled_shapes(), _write_slot._cache_size()) == (compiled, writes)
        assert llm._core.runner.lora.slots.loaded == [others[-1].lora_name]



def test_chunked_prefill_and_preemption_keep_adapter_outputs(lora_base, adapters, prompts):
    """Prefill chunks of 8 tokens beside decodes, and a pool so small that requests are preempted and recomputed
    (their slots given back and taken again): the same tokens as with room for everything."""
    model_dir, _ = lora_base
    requests = _requests(adapters)[:2] + [None]
    pairs = [(p, r) for p in prompts for r in requests]
    plain = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def run(**engine) -> tuple[list[list[int]], int]:
        with LLM(str(model_dir), dtype="float32", max_model_len=48, enable_lora=True, max_loras=2,
                 max_lora_rank=16, **engine) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p, _ in pairs], plain, use_tqdm=False,
                                lora_request=[r for _, r in pairs])
            assert_nothing_leaked(llm)
            return [o.outputs[0].token_ids for o in outs], llm._core.scheduler.num_preemptions_total

    roomy, _ = run()
    tight, preemptions = run(max_num_batched_tokens=8, num_gpu_blocks_override=6, block_size=8)
    assert tight == roomy and preemptions > 0, f"seed {SEED}"
