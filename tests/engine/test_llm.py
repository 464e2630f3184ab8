"""LLM over a fake core: input order, all-or-nothing validation, bounded feeding, stop strings, shutdown."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from jengine.errors import ContextLengthExceededError, EngineDeadError, InvalidRequestError
from jengine.llm import LLM
from jengine.request import RequestStatus
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import Tokenizer

from tests.engine.conftest import FakeCore, make_parts

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _llm(tokenizer: Tokenizer, core: FakeCore | None = None, **limits: int) -> tuple[LLM, FakeCore]:
    parts = make_parts(tokenizer, core, **limits)
    return LLM.from_parts(parts), parts.core  # type: ignore[arg-type]


def test_generate_keeps_input_order_and_bounds_the_core(tokenizer: Tokenizer) -> None:
    llm, core = _llm(tokenizer, FakeCore(max_num_seqs=2), max_num_seqs=2, max_num_queued_reqs=1)
    prompts = [f"prompt number {i}" for i in range(10)]
    params = [SamplingParams(max_tokens=2 + i % 3, ignore_eos=True) for i in range(10)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2 + i % 3 for i in range(10)]
    assert all(o.finished for o in outputs)
    assert core.max_held == 3 and core.num_requests() == 0


def test_prompt_forms_and_one_params(tokenizer: Tokenizer) -> None:
    llm, _ = _llm(tokenizer)
    ids = tokenizer.encode("Hi there")
    single = llm.generate("Hi there", PARAMS, use_tqdm=False)
    assert len(single) == 1 and single[0].prompt_token_ids == ids
    many = llm.generate([{"prompt_token_ids": ids}, ids, {"prompt": "Hi there"}], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in many] == [single[0].outputs[0].token_ids] * 3
    assert llm.generate(ids, PARAMS, use_tqdm=False)[0].prompt is None
    assert llm.generate([], PARAMS, use_tqdm=False) == []
    # vLLM habits: token ids as a numpy array, prompt keys that ask for nothing, lora_request=None, clone()
    as_vllm = llm.generate([np.array(ids), {"prompt_token_ids": ids, "multi_modal_data": None}],
                           PARAMS.clone(max_tokens=3), use_tqdm=False, lora_request=None)
    assert [o.outputs[0].token_ids for o in as_vllm] == [single[0].outputs[0].token_ids[:3]] * 2
    with pytest.raises(InvalidRequestError, match="lora_request"):
        llm.generate("Hi", PARAMS, use_tqdm=False, lora_request=object())  # type: ignore[arg-type]


def test_a_bad_prompt_leaves_nothing_in_the_engine(tokenizer: Tokenizer) -> None:
    llm, core = _llm(tokenizer, max_model_len=16)
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", ""], PARAMS, use_tqdm=False)
    with pytest.raises(ContextLengthExceededError):
        llm.generate(["fine", "a much longer prompt than sixteen tokens can hold, surely"], PARAMS, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="sampling_params"):
        llm.generate(["a", "b"], [PARAMS], use_tqdm=False)
    assert core.added == []


def test_n_and_stop_strings(tokenizer: Tokenizer) -> None:
    llm, core = _llm(tokenizer, FakeCore(max_num_seqs=2), max_num_seqs=2, max_num_queued_reqs=0)
    params = SamplingParams(n=3, max_tokens=20, ignore_eos=True, stop="world")
    [out] = llm.generate("Hello, world!", params, use_tqdm=True)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "stop" and "world" not in c.text for c in out.outputs)
    assert {status for _, status in core.aborted} == {RequestStatus.FINISHED_STOPPED}
    assert core.num_requests() == 0


def test_chat(tokenizer: Tokenizer, tmp_path) -> None:
    llm, _ = _llm(tokenizer)
    conversation = [{"role": "user", "content": "Hi"}]
    [one] = llm.chat(conversation, PARAMS, use_tqdm=False)
    assert one.prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert len(llm.chat([conversation, conversation], PARAMS, use_tqdm=False)) == 2
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    assert llm.chat(parts, PARAMS, use_tqdm=False)[0].prompt == one.prompt.replace("Hi", "H\ni")
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}!")
    assert llm.chat(conversation, PARAMS, chat_template=str(template), use_tqdm=False)[0].prompt == "Hi!"


def test_offline_output_stops_at_the_end_of_the_context(tokenizer: Tokenizer) -> None:
    """As vLLM's LLM: a max_tokens reaching past max_model_len ends the output there ("length"), the other prompts
    of the batch unaffected; a prompt with no room at all is still refused."""
    llm, _ = _llm(tokenizer, max_model_len=24)
    prompt = tokenizer.encode("Hello, world! How are you today?")
    short, long_ = llm.generate([{"prompt_token_ids": prompt}, "Hi"],
                                SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert len(short.outputs[0].token_ids) == 24 - len(prompt) < 20 and short.outputs[0].finish_reason == "length"
    assert len(long_.outputs[0].token_ids) == 20


def test_offline_choices_and_params_mistakes(tokenizer: Tokenizer) -> None:
    """Offline n goes past a server's cap (pass@k); a dict in place of SamplingParams gets a message saying so."""
    llm, _ = _llm(tokenizer)
    [out] = llm.generate("Hi", SamplingParams(n=40, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs) == 40
    with pytest.raises(InvalidRequestError, match="got dict"):
        llm.generate("Hi", {"max_tokens": 2}, use_tqdm=False)  # type: ignore[arg-type]


def test_failing_step_kills_the_llm(tokenizer: Tokenizer) -> None:
    llm, _ = _llm(tokenizer, FakeCore(fail_at_step=2))
    with pytest.raises(EngineDeadError) as info:
        llm.generate(["a", "b"], PARAMS, use_tqdm=False)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(EngineDeadError):
        llm.generate("a", PARAMS, use_tqdm=False)


def test_interrupted_generate_cleans_the_core(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    llm, core = _llm(tokenizer, max_num_seqs=2, max_num_queued_reqs=0)
    real_step, calls = core.step, []

    def interrupted_step() -> list:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(core, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b", "c"], PARAMS, use_tqdm=False)
    assert core.num_requests() == 0 and sorted(i for i, _ in core.aborted) == ["0", "1"]
    assert llm.generate("again", PARAMS, use_tqdm=False)[0].finished  # still usable


def test_shutdown_and_context_manager(tokenizer: Tokenizer) -> None:
    llm, core = _llm(tokenizer)
    with llm:
        assert llm.get_tokenizer() is tokenizer
    assert core.shut_down
    with pytest.raises(EngineDeadError):
        llm.generate("Hi", PARAMS, use_tqdm=False)
    llm.shutdown()  # idempotent


def test_import_jengine_does_not_import_jax() -> None:
    code = ("import sys, jengine; from jengine import LLM, SamplingParams, EngineConfig, RequestOutput, "
            "CompletionOutput; import jengine.clients.async_engine; assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
