"""Speculation with adapters: a verification step runs the request's adapter over its last token and drafts, so
greedy tokens equal the plain engine's with the same adapter (and the base's without one)."""

from __future__ import annotations

from jengine import LLM, LoRARequest, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_ngram_with_an_adapter_keeps_greedy_output(lora_base, make_adapter):
    model_dir, _ = lora_base
    adapter_dir, _ = make_adapter(4)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 5}, {"prompt_token_ids": [9, 10, 11] * 6}]
    requests = [LoRARequest("a", 1, str(adapter_dir)), None]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(**engine_args):
        with LLM(str(model_dir), dtype="float32", max_model_len=128, enable_lora=True, max_lora_rank=4,
                 **engine_args) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
            counts = llm._core.scheduler.spec_counts
        return [o.outputs[0].token_ids for o in outputs], counts

    plain, _ = run()
    speculative, counts = run(speculative_config=NGRAM)
    assert speculative == plain and counts.num_draft_tokens > 0
