"""Structured output under a reasoning parser (`--reasoning-parser qwen3`): the reply reasons freely until `</think>`,
then the grammar applies; the span goes to `reasoning` and the constrained part to the content (or tool calls).

The demo model's tokenizer here has `<think>` and `</think>` as added (non-special) tokens, as Qwen3's and
DeepSeek-R1's do. With random weights, a logit_bias on `</think>` makes the span end after a few free tokens
(deterministic per seed), and EOS is biased away so the span cannot stop the reply early; once the grammar applies it
bans `</think>` and allows EOS only where the JSON is complete, whatever the biases.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AddedToken, AutoTokenizer, LlamaConfig

from jengine import LLM, SamplingParams, StructuredOutputsParams
from jengine.tokenizer import CHATML_TEMPLATE, train_tiny_tokenizer
from jengine.v1 import jengine_pb2 as pb
from tests.conftest import COMMON, TOKENIZER_VOCAB
from tests.server.conftest import Servers, ServerHandle
from tests.server.grpc_fixtures import auth, start_harness, stop_harness
from tests.server.test_structured import JSON_SCHEMA_FORMAT, SCHEMA, TOOLS, WEATHER, TIME
from tests.server.test_tool_calls import _reassemble

MODEL = "tiny-think"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def think_model_dir(build_checkpoint: Callable, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = train_tiny_tokenizer(tmp_path_factory.mktemp("think_tokenizer"), vocab_size=TOKENIZER_VOCAB - 2,
                                     chat_template=CHATML_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    assert len(tokenizer) == TOKENIZER_VOCAB
    tokenizer.save_pretrained(directory)
    return build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=directory)[0]


@pytest.fixture(scope="module")
def thinker(servers: Servers, think_model_dir: Path) -> tuple[ServerHandle, dict[str, int]]:
    handle = servers.start(think_model_dir, served_model_name=MODEL, reasoning_parser="qwen3")
    tokenizer = AutoTokenizer.from_pretrained(think_model_dir)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("</think>", "</s>", "<|im_end|>")}
    yield handle, ids
    handle.wait_idle()


def _bias(ids: dict[str, int], end: float) -> dict[str, float]:
    return {str(ids["</think>"]): end, str(ids["</s>"]): -100, str(ids["<|im_end|>"]): -100}


def _chat(ids: dict[str, int], end_bias: float = 5.0, **kwargs: Any) -> dict[str, Any]:
    return dict(model=MODEL, messages=USER, temperature=1.0, logit_bias=_bias(ids, end_bias), **kwargs)


def test_the_grammar_applies_after_the_reasoning(thinker: tuple[ServerHandle, dict[str, int]]) -> None:
    handle, ids = thinker
    reasonings = []
    for seed in range(4):
        choice = handle.client().chat.completions.create(
            **_chat(ids, response_format=JSON_SCHEMA_FORMAT, max_tokens=160, seed=seed)).choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        extra = choice.message.model_extra
        assert extra["reasoning"] == extra["reasoning_content"]
        reasonings.append(extra["reasoning"] or "")
    # the span is free text the schema's grammar would not allow (it would have to open with "{")
    assert any(r and not r.startswith("{") for r in reasonings), reasonings
    handle.wait_idle()


def test_streamed_equals_non_streamed(thinker: tuple[ServerHandle, dict[str, int]]) -> None:
    handle, ids = thinker
    kwargs = _chat(ids, response_format=JSON_SCHEMA_FORMAT, max_tokens=160, seed=1)
    choice = handle.client().chat.completions.create(**kwargs).choices[0]
    streamed = _reassemble(list(handle.client().chat.completions.create(stream=True, **kwargs)))
    assert streamed == (choice.message.content, choice.message.model_extra["reasoning"] or "", [], "stop")
    handle.wait_idle()


def test_include_reasoning_false_leaves_the_reasoning_out(thinker: tuple[ServerHandle, dict[str, int]]) -> None:
    """vLLM's include_reasoning: false: the same reply, its span still kept out of the content, without the reasoning
    fields (streamed: no chunk carries them)."""
    handle, ids = thinker
    kwargs = _chat(ids, response_format=JSON_SCHEMA_FORMAT, max_tokens=160, seed=1)
    full = handle.client().chat.completions.create(**kwargs).choices[0]
    assert full.message.model_extra["reasoning"]
    left_out = handle.client().chat.completions.create(**kwargs, extra_body={"include_reasoning": False}).choices[0]
    assert left_out.message.content == full.message.content and left_out.finish_reason == "stop"
    assert not {"reasoning", "reasoning_content"} & set(left_out.message.model_extra or {})
    chunks = list(handle.client().chat.completions.create(stream=True, **kwargs,
                                                          extra_body={"include_reasoning": False}))
    assert not any({"reasoning", "reasoning_content"} & set(c.delta.model_extra or {})
                   for chunk in chunks for c in chunk.choices)
    assert _reassemble(chunks) == (full.message.content, "", [], "stop")
    with pytest.raises(openai.BadRequestError, match="include_reasoning"):
        handle.client().chat.completions.create(**kwargs, extra_body={"include_reasoning": "no"})
    handle.wait_idle()


def test_forced_tool_calls_after_the_reasoning(thinker: tuple[ServerHandle, dict[str, int]]) -> None:
    handle, ids = thinker
    kwargs = _chat(ids, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                   seed=2)
    choice = handle.client().chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), {"get_weather": WEATHER, "get_time": TIME}[
        call.function.name])
    content, reasoning, calls, finish = _reassemble(list(handle.client().chat.completions.create(stream=True,
                                                                                                 **kwargs)))
    assert (content, reasoning, finish) == ("", choice.message.model_extra["reasoning"] or "", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    handle.wait_idle()


def test_a_prompt_that_closed_the_span_is_constrained_from_the_first_token(
        thinker: tuple[ServerHandle, dict[str, int]]) -> None:
    """A template that turns thinking off ends the prompt with an empty span: the reply is all content, valid."""
    handle, ids = thinker
    messages = [*USER, {"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
    choice = handle.client().chat.completions.create(
        **{**_chat(ids, end_bias=100, response_format=JSON_SCHEMA_FORMAT, max_tokens=120, seed=3),
           "messages": messages}, extra_body={"add_generation_prompt": False, "continue_final_message": True}
    ).choices[0]
    assert choice.finish_reason == "stop" and not (choice.message.model_extra or {}).get("reasoning")
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    handle.wait_idle()


def test_a_prompt_inside_the_span_and_max_tokens_while_reasoning(
        thinker: tuple[ServerHandle, dict[str, int]]) -> None:
    """A prompt ending inside `<think>` reasons first; cut by max_tokens before `</think>`, the reply is all
    reasoning and ends with "length", the grammar never having applied."""
    handle, ids = thinker
    messages = [*USER, {"role": "assistant", "content": "<think>\n"}]
    choice = handle.client().chat.completions.create(
        **{**_chat(ids, end_bias=-100, response_format=JSON_SCHEMA_FORMAT, max_tokens=6, seed=4),
           "messages": messages}, extra_body={"add_generation_prompt": False, "continue_final_message": True}
    ).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.model_extra["reasoning"]
    handle.wait_idle()


def test_over_grpc_the_reasoning_and_the_constrained_content_are_apart(
        think_model_dir: Path, thinker: tuple[ServerHandle, dict[str, int]]) -> None:
    """The gRPC service reads a chat the same way: reasoning deltas first, then content that validates."""
    _, ids = thinker
    harness = start_harness(think_model_dir, reasoning_parser="qwen3")
    try:
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
        sampling = pb.SamplingParams(temperature=1.0, seed=1, max_tokens=160,
                                     logit_bias={int(k): v for k, v in _bias(ids, 5.0).items()})
        fmt = pb.ResponseFormat(type="json_schema", json_schema=json.dumps(SCHEMA))
        responses = harness.stub.Generate(pb.GenerateRequest(messages=chat, sampling=sampling, response_format=fmt),
                                          metadata=auth(), timeout=60)
        deltas = [c.chat for r in responses for c in r.outputs]
        jsonschema.validate(json.loads("".join(d.content for d in deltas)), SCHEMA)
        http = _reassemble(list(thinker[0].client().chat.completions.create(
            stream=True, **_chat(ids, response_format=JSON_SCHEMA_FORMAT, max_tokens=160, seed=1))))
        assert "".join(d.reasoning for d in deltas) == http[1]  # the same seed reasons the same over HTTP
    finally:
        stop_harness(harness)


def test_offline_chat_reads_the_reasoning_and_the_constrained_content(
        think_model_dir: Path, thinker: tuple[ServerHandle, dict[str, int]]) -> None:
    _, ids = thinker
    bias = {int(k): v for k, v in _bias(ids, 5.0).items()}
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=160, logit_bias=bias,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)) for seed in range(2)]
    with LLM(str(think_model_dir), dtype="float32", max_model_len=256, reasoning_parser="qwen3") as llm:
        outputs = llm.chat([USER, USER], params, use_tqdm=False)
    for output in outputs:
        (choice,) = output.outputs
        reasoning, _, content = choice.text.partition("</think>")
        assert choice.finish_reason == "stop" and choice.message.content == content
        assert (choice.message.reasoning or "") == reasoning.strip()
        jsonschema.validate(json.loads(content), SCHEMA)
