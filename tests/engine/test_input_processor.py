"""The input processor refuses every bad request with an error naming the problem, and never truncates."""

from __future__ import annotations

import numpy as np
import pytest

from jengine.front.input_processor import InputProcessor
from jengine.errors import ContextLengthExceededError, InvalidRequestError
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import Tokenizer

MAX_LEN = 32


@pytest.fixture
def processor(tokenizer: Tokenizer) -> InputProcessor:
    return InputProcessor(tokenizer, tokenizer.vocab_size, MAX_LEN, max_logprobs=5, model_eos_token_ids=(4,))


def _process(processor: InputProcessor, prompt: object, **params: object) -> object:
    return processor.process(prompt, SamplingParams(**params), "r", arrival_time=1.0)  # type: ignore[arg-type]


def test_prompt_forms(processor: InputProcessor, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello, world!")
    assert ids[0] == tokenizer.bos_token_id
    for prompt in ("Hello, world!", {"prompt": "Hello, world!"}, ids, {"prompt_token_ids": ids}):
        processed = _process(processor, prompt)
        assert processed.prompt_token_ids == ids
    assert _process(processor, "Hello, world!").prompt == "Hello, world!"
    assert _process(processor, ids).prompt is None
    assert _process(processor, {"prompt_token_ids": ids, "prompt": "x"}).prompt == "x"


def test_numpy_integer_ids_accepted_as_plain_ints(processor: InputProcessor) -> None:
    """Token ids from numpy (a tokenizer's array, a dataset column) are ids too, stored as Python ints; a tuple is a
    sequence of ids like a list."""
    processed = _process(processor, {"prompt_token_ids": [np.int64(5), np.int32(7), 9]})
    assert processed.prompt_token_ids == [5, 7, 9] and all(type(t) is int for t in processed.prompt_token_ids)
    assert _process(processor, {"prompt_token_ids": (5, 7)}).prompt_token_ids == [5, 7]


def test_request_fields(processor: InputProcessor, tokenizer: Tokenizer) -> None:
    processed = processor.process("Hi", SamplingParams(max_tokens=5), "r", priority=3, arrival_time=7.0)
    [request] = processed.children
    assert (request.request_id, request.choice_index, request.priority, request.arrival_time) == ("r", 0, 3, 7.0)
    assert request.eos_token_ids == tokenizer.eos_token_ids | {4}
    assert request.sampling_params.max_tokens == 5


@pytest.mark.parametrize("prompt", ["", {"prompt": ""}, [], {"prompt_token_ids": []}])
def test_empty_prompt_refused(processor: InputProcessor, prompt: object) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        _process(processor, prompt)


@pytest.mark.parametrize("bad", [-1, 99_999])
def test_out_of_range_token_id_named(processor: InputProcessor, bad: int) -> None:
    with pytest.raises(InvalidRequestError, match=str(bad)) as info:
        _process(processor, [1, 5, bad])
    assert info.value.param == "prompt_token_ids" and "position 2" in str(info.value)


def test_model_vocab_bounds_ids(tokenizer: Tokenizer) -> None:
    small = InputProcessor(tokenizer, 300, MAX_LEN, 5)
    _process(small, [1, 299])
    with pytest.raises(InvalidRequestError, match="300"):
        _process(small, [1, 300])
    padded = InputProcessor(tokenizer, tokenizer.vocab_size + 64, MAX_LEN, 5)  # embedding padded past the tokenizer
    with pytest.raises(InvalidRequestError):
        _process(padded, [1, tokenizer.vocab_size])


@pytest.mark.parametrize("prompt", [[1, True], [1, "2"], {"prompt_token_ids": "12"}, {"text": "hi"}, 3.5, b"hi"])
def test_malformed_prompts(processor: InputProcessor, prompt: object) -> None:
    with pytest.raises(InvalidRequestError):
        _process(processor, prompt)


def test_prompt_filling_the_context_refused(processor: InputProcessor) -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        _process(processor, list(range(3, 3 + MAX_LEN)))
    assert str(MAX_LEN) in str(info.value) and info.value.code == "context_length_exceeded"


def test_prompt_plus_max_tokens_over_limit_states_both(processor: InputProcessor) -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        _process(processor, list(range(3, 23)), max_tokens=13)  # 20 + 13 > 32
    message = str(info.value)
    assert "20" in message and "13" in message and str(MAX_LEN) in message
    assert _process(processor, list(range(3, 23)), max_tokens=12).params.max_tokens == 12  # fits exactly


def test_max_tokens_none_is_what_is_left(processor: InputProcessor) -> None:
    assert _process(processor, list(range(3, 13)), max_tokens=None).params.max_tokens == MAX_LEN - 10
    with pytest.raises(ContextLengthExceededError):
        _process(processor, list(range(3, 13)), max_tokens=None, min_tokens=MAX_LEN)


@pytest.mark.parametrize("params, field", [
    ({"n": 17}, "n"), ({"logprobs": 6}, "logprobs"), ({"prompt_logprobs": 6}, "prompt_logprobs"),
    ({"temperature": -1.0}, "temperature"), ({"stop": [f"s{i}" for i in range(65)]}, "stop"),
    ({"stop_token_ids": [100_000]}, "stop_token_ids"), ({"stop": "x", "detokenize": False}, "stop"),
])
def test_params_validated(processor: InputProcessor, params: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        _process(processor, "Hi", **params)
    assert info.value.param == field


def test_not_sampling_params_refused(processor: InputProcessor) -> None:
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        processor.process("Hi", {"n": 2}, "r", arrival_time=0.0)  # type: ignore[arg-type]


def test_n_fans_out_into_children(processor: InputProcessor) -> None:
    processed = _process(processor, "Hi", n=3)
    assert processed.child_ids == ["r-0", "r-1", "r-2"]
    assert [request.choice_index for request in processed.children] == [0, 1, 2]
    assert len({id(request) for request in processed.children}) == 3
    assert all(r.prompt_token_ids == processed.prompt_token_ids for r in processed.children)


def test_chat_renders_the_template(processor: InputProcessor, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hello!"}]
    params = SamplingParams(max_tokens=4)
    processed = processor.process_chat(messages, params, "c", arrival_time=0.0)
    assert processed.prompt == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    assert processed.prompt_token_ids == tokenizer.encode_chat(messages)
    custom = processor.process_chat(messages, params, "c", arrival_time=0.0,
                                    chat_template="{{ messages[0]['content'] }}!", add_generation_prompt=False)
    assert custom.prompt == "Hello!!"
    greeting = Tokenizer(tokenizer.hf_tokenizer, chat_template="{{ greeting }} {{ messages[0]['content'] }}")
    kwargs_processor = InputProcessor(greeting, tokenizer.vocab_size, MAX_LEN, max_logprobs=5)
    text, _ = kwargs_processor.tokenize({"messages": messages, "chat_template_kwargs": {"greeting": "Hey"}})
    assert text == "Hey Hello!"
    for bad, field in (({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
                       ({"continue_final_message": "yes"}, "continue_final_message")):
        with pytest.raises(InvalidRequestError) as info:
            processor.tokenize({"messages": messages, **bad})
        assert info.value.param == field
    with pytest.raises(InvalidRequestError):
        processor.process_chat([], params, "c", arrival_time=0.0)
