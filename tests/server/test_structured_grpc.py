"""Structured output over gRPC: `GenerateRequest.response_format` constrains the output (random weights, valid
outputs), and the gRPC-backed client's wire form of every constraint kind round-trips."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from jengine.sampling.params import StructuredOutputsParams
from jengine.v1 import jengine_pb2 as pb
from server.grpc_structured import structured_from_proto, structured_to_proto
from tests.server.grpc_fixtures import GrpcHarness, auth, start_harness, stop_harness, streamed_tool_calls


@pytest.fixture(scope="module")
def harness(chat_model_dir) -> Iterator[GrpcHarness]:
    started = start_harness(chat_model_dir)
    yield started
    stop_harness(started)


def _text(harness: GrpcHarness, **fields) -> str:
    responses = harness.stub.Generate(pb.GenerateRequest(text="hi", **fields), metadata=auth(), timeout=30)
    return "".join(c.text for r in responses for c in r.outputs)


def test_response_format_constrains_the_output(harness: GrpcHarness) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["n"], "additionalProperties": False}
    sampling = pb.SamplingParams(temperature=1.0, seed=4, max_tokens=30)
    fmt = pb.ResponseFormat(type="json_schema", json_schema=json.dumps(schema))
    jsonschema.validate(json.loads(_text(harness, sampling=sampling, response_format=fmt)), schema)
    fmt = pb.ResponseFormat(type="choice", choice=["left", "right"])
    assert _text(harness, sampling=sampling, response_format=fmt) in ("left", "right")


@pytest.mark.parametrize("params", [
    StructuredOutputsParams(json={"type": "object"}), StructuredOutputsParams(regex="a+"),
    StructuredOutputsParams(choice=["x", "y"]), StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(grammar='start: "a"', disable_any_whitespace=False),
    StructuredOutputsParams(structural_tag={"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}]}),
])
def test_wire_form_round_trips(params: StructuredOutputsParams) -> None:
    assert structured_from_proto(pb.GenerateRequest(response_format=structured_to_proto(params))) == params


def test_a_forced_tool_choice_streams_calls_over_grpc(harness: GrpcHarness) -> None:
    """tool_choice "required" in the chat: the grammar makes the reply calls, read into ChatDelta tool calls that
    put together give valid arguments (random weights)."""
    parameters = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                  "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="weather?")], tools_json=json.dumps(tools),
                           tool_choice=pb.ToolChoice(mode="required"), parallel_tool_calls=False)
    responses = list(harness.stub.Generate(pb.GenerateRequest(
        messages=chat, sampling=pb.SamplingParams(temperature=1.0, seed=3, max_tokens=60)), metadata=auth(),
        timeout=30))
    deltas = [c.chat for r in responses for c in r.outputs]
    calls = streamed_tool_calls(deltas)
    assert [name for name, _ in calls.values()] == ["get_weather"] and deltas[-1].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0][1]), parameters)
    assert not "".join(d.content for d in deltas)
