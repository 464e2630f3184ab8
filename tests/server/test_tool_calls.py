"""Tool calls and reasoning over HTTP with the official `openai` client, end to end through the real app.

The model is scripted (random weights would never write a call): a fake EngineClient answers each chat with the
reply its last user message names, in small pieces that split the markup across "tokens", as a real model's would
be. The server's parsers are configured as `--reasoning-parser qwen3 --tool-call-parser hermes
--enable-auto-tool-choice` would configure them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from jengine.clients.protocol import ModelInfo
from jengine.config import ChatParsingConfig
from jengine.engine.stats import EngineStats
from jengine.outputs import CompletionOutput, RequestOutput
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import Tokenizer
from tests.server.conftest import Servers, ServerHandle
from tests.server.grpc_fixtures import streamed_tool_calls

WEATHER_ARGS = {"city": "Paris", "unit": "celsius"}
REPLIES = {
    "weather": ('<think>\nThe user wants the weather in Paris and the time.\n</think>\n\n<tool_call>\n'
                f'{{"name": "get_weather", "arguments": {json.dumps(WEATHER_ARGS)}}}\n</tool_call>\n<tool_call>\n'
                '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'),
    "sum": "<think>\n2 + 2 is 4.\n</think>\n\nThe answer is 4.",
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} of a place",
                                           "parameters": {"type": "object", "properties": {}}}}
         for name in ("get_weather", "get_time")]
PIECE = 3  # characters per scripted token: every tag arrives split
TOOLS_TEMPLATE = (  # ChatML with Hermes-style tools, tool calls and tool results
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ScriptedChat:
    """An EngineClient whose model writes the scripted reply; it records the params of each request."""

    def __init__(self, tokenizer: Tokenizer, parsing: ChatParsingConfig) -> None:
        self.tokenizer = tokenizer
        self.parsing = parsing
        self.params: list[SamplingParams] = []

    async def generate(self, prompt: Any, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0) -> AsyncIterator[RequestOutput]:
        assert sampling_params is not None
        self.params.append(sampling_params)
        reply = next(text for key, text in REPLIES.items() if f"user\n{key}<" in prompt["prompt"])
        pieces = [reply[i:i + PIECE] for i in range(0, len(reply), PIECE)]
        for n, piece in enumerate(pieces):
            last = n == len(pieces) - 1
            yield RequestOutput(request_id or "r", prompt["prompt"], prompt["prompt_token_ids"], None,
                                [CompletionOutput(0, piece, [7], None, None, "stop" if last else None)], last)

    async def abort(self, request_id: str) -> None:
        pass

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_model_info(self) -> ModelInfo:
        return ModelInfo("scripted", "/nowhere", 4096, self.tokenizer.vocab_size, 20, chat_parsing=self.parsing)

    def is_healthy(self) -> bool:
        return True

    def stats(self) -> EngineStats:
        return EngineStats()

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def scripted(chat_tokenizer_dir: Path, servers: Servers) -> dict[str, tuple[ServerHandle, ScriptedChat]]:
    tokenizer = Tokenizer(Tokenizer.from_pretrained(chat_tokenizer_dir).hf_tokenizer, chat_template=TOOLS_TEMPLATE)
    out = {}
    for name, parsing in (("hermes", ChatParsingConfig("qwen3", "hermes", True)),
                          ("mistral", ChatParsingConfig(None, "mistral", True))):
        engine = ScriptedChat(tokenizer, parsing)
        out[name] = (servers.serve(engine), engine)
    return out


def _ask(handle: ServerHandle, key: str, **kwargs: Any) -> Any:
    return handle.client().chat.completions.create(model="scripted", messages=[{"role": "user", "content": key}],
                                                   **kwargs)


def _reassemble(chunks: list[Any]) -> tuple[str, str, list[dict[str, Any]], str | None]:
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            extra = delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning += extra.get("reasoning") or ""
            for call in delta.tool_calls or ():
                if call.id is not None:
                    assert call.index == len(calls) and call.type == "function" and call.function.name
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, list(calls.values()), finish


def test_tool_calls_and_reasoning_in_the_response(scripted: dict[str, tuple[ServerHandle, ScriptedChat]]) -> None:
    response = _ask(scripted["hermes"][0], "weather", tools=TOOLS)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning"] == choice.message.model_extra["reasoning_content"] == (
        "The user wants the weather in Paris and the time.")
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name) for c in calls] == [("function", "get_weather"), ("function", "get_time")]
    assert json.loads(calls[0].function.arguments) == WEATHER_ARGS
    assert len({c.id for c in calls}) == 2


def test_streamed_deltas_reassemble_to_the_response(scripted: dict[str, tuple[ServerHandle, ScriptedChat]]) -> None:
    handle = scripted["hermes"][0]
    whole = _ask(handle, "weather", tools=TOOLS).choices[0].message
    chunks = list(_ask(handle, "weather", tools=TOOLS, stream=True))
    content, reasoning, calls, finish = _reassemble(chunks)
    assert (content, reasoning, finish) == ("", whole.model_extra["reasoning"], "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                            for c in whole.tool_calls]
    argument_chunks = [call for chunk in chunks for choice in chunk.choices for call in choice.delta.tool_calls or ()]
    assert len(argument_chunks) > len(calls)  # the arguments arrive in pieces, after the call's id and name


def test_reasoning_is_split_from_the_content(scripted: dict[str, tuple[ServerHandle, ScriptedChat]]) -> None:
    handle = scripted["hermes"][0]
    message = _ask(handle, "sum").choices[0].message
    assert (message.content, message.model_extra["reasoning"]) == ("The answer is 4.", "2 + 2 is 4.")
    chunks = list(_ask(handle, "sum", stream=True))
    assert all("<" not in (c.delta.content or "") for chunk in chunks for c in chunk.choices)
    content, reasoning, calls, finish = _reassemble(chunks)
    assert (content, reasoning, calls, finish) == ("The answer is 4.", "2 + 2 is 4.", [], "stop")


def test_tool_choice_none_leaves_the_calls_in_the_content(
        scripted: dict[str, tuple[ServerHandle, ScriptedChat]]) -> None:
    choice = _ask(scripted["hermes"][0], "weather", tools=TOOLS, tool_choice="none").choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content.startswith("<tool_call>")  # the reasoning still goes apart


def test_parallel_tool_calls_false_keeps_the_first(scripted: dict[str, tuple[ServerHandle, ScriptedChat]]) -> None:
    handle = scripted["hermes"][0]
    calls = _ask(handle, "weather", tools=TOOLS, parallel_tool_calls=False).choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    _, _, streamed, _ = _reassemble(list(_ask(handle, "weather", tools=TOOLS, parallel_tool_calls=False,
                                              stream=True)))
    assert [c["name"] for c in streamed] == ["get_weather"]


def test_mistral_markers_survive_decoding(scripted: dict[str, tuple[ServerHandle, ScriptedChat]]) -> None:
    handle, engine = scripted["mistral"]
    choice = _ask(handle, "mistral", tools=TOOLS).choices[0]
    assert engine.params[-1].skip_special_tokens is False  # [TOOL_CALLS] is a special token
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert len(call.id) == 9 and call.id.isalnum() and "reasoning" not in choice.message.model_extra


def test_assistant_tool_calls_and_tool_results_are_accepted(
        scripted: dict[str, tuple[ServerHandle, ScriptedChat]]) -> None:
    messages = [{"role": "user", "content": "sum"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    response = scripted["hermes"][0].client().chat.completions.create(model="scripted", messages=messages,
                                                                       tools=TOOLS)
    assert response.choices[0].message.content == "The answer is 4."


def test_the_template_sees_tools_tool_calls_and_tool_results(
        scripted: dict[str, tuple[ServerHandle, ScriptedChat]]) -> None:
    messages = [{"role": "user", "content": "time?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    response = scripted["hermes"][0].http.post("/tokenize", json={"messages": messages, "tools": TOOLS[:1]})
    prompt = scripted["hermes"][1].tokenizer.decode(response.json()["tokens"], skip_special_tokens=False)
    assert prompt == ("<|im_start|>system\n<tools>" + json.dumps(TOOLS[0]) + "</tools><|im_end|>\n"
                      "<|im_start|>user\ntime?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
                      '{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call><|im_end|>\n'
                      "<|im_start|>tool\n12:00<|im_end|>\n<|im_start|>assistant\n")


def test_auto_needs_the_server_flag(server: ServerHandle) -> None:
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice") as info:
        server.client().chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                                tools=TOOLS, max_tokens=2)
    assert info.value.body["param"] == "tool_choice"
    reply = server.client().chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                                    tools=TOOLS, tool_choice="none", max_tokens=2)
    assert reply.choices[0].finish_reason == "length" and not reply.choices[0].message.tool_calls


@pytest.fixture(scope="module")
def grpc_stub(scripted: dict[str, tuple[ServerHandle, ScriptedChat]]) -> Iterator[Any]:
    """The gRPC service over the same scripted engine (qwen3 + hermes)."""
    grpc = pytest.importorskip("grpc")
    from jengine.v1 import jengine_pb2_grpc as pb_grpc
    from server.grpc_service import start_grpc_server
    from tests.server.grpc_fixtures import LoopThread

    loops = LoopThread()
    server = loops.run(start_grpc_server(scripted["hermes"][1], "127.0.0.1", 0))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.EngineStub(channel)
    stub.address = f"127.0.0.1:{server.port}"
    yield stub
    channel.close()
    loops.run(server.stop(None))
    loops.close()


def test_grpc_carries_tools_and_answers_with_read_deltas(
        scripted: dict[str, tuple[ServerHandle, ScriptedChat]], grpc_stub: Any) -> None:
    from jengine.v1 import jengine_pb2 as pb

    whole = _ask(scripted["hermes"][0], "weather", tools=TOOLS).choices[0].message
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="weather")], tools_json=json.dumps(TOOLS))
    responses = list(grpc_stub.Generate(pb.GenerateRequest(messages=chat)))
    assert "get_weather" in responses[0].prompt  # the template listed the tools
    deltas = [delta.chat for response in responses for delta in response.outputs]
    reasoning = "".join(d.reasoning for d in deltas)
    calls = streamed_tool_calls(deltas)
    assert reasoning == whole.model_extra["reasoning"] and "".join(d.content for d in deltas) == ""
    assert list(calls.values()) == [[c.function.name, c.function.arguments] for c in whole.tool_calls]
    assert deltas[-1].finish_reason == "tool_calls" and responses[-1].outputs[-1].finish_reason == "stop"
    none = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="weather")], tools_json=json.dumps(TOOLS),
                           tool_choice=pb.ToolChoice(mode="none"))
    texts = [d.chat.content for r in grpc_stub.Generate(pb.GenerateRequest(messages=none)) for d in r.outputs]
    assert "".join(texts).startswith("<tool_call>")  # reasoning still read, calls left in the content


def test_grpc_refuses_bad_tools(grpc_stub: Any) -> None:
    grpc = pytest.importorskip("grpc")
    from jengine.v1 import jengine_pb2 as pb

    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="weather")], tools_json=json.dumps(TOOLS),
                           tool_choice=pb.ToolChoice(function_name="nope"))
    with pytest.raises(grpc.RpcError) as info:
        list(grpc_stub.Generate(pb.GenerateRequest(messages=chat)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nope" in info.value.details()


def test_tool_messages_round_trip_through_the_proto() -> None:
    pytest.importorskip("grpc")
    from server.grpc_convert import chat_options_from_proto, messages_from_proto, messages_to_proto

    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
                 "reasoning_content": "think"},
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    msg = messages_to_proto(messages, tools=TOOLS)
    assert messages_from_proto(msg) == messages
    assert chat_options_from_proto(msg)["tools"] == TOOLS


def test_a_remote_engine_renders_tools_and_reports_its_parsers(
        scripted: dict[str, tuple[ServerHandle, ScriptedChat]], grpc_stub: Any) -> None:
    """What `jengine openai --engine` relies on: the engine's parser flags in its model info, tools sent for the
    template only (the shim reads the reply itself from the raw text)."""
    import asyncio

    from server.grpc_client import GrpcEngineClient

    client = GrpcEngineClient(grpc_stub.address)
    try:
        assert client.get_model_info().chat_parsing == ChatParsingConfig("qwen3", "hermes", True)
        assert "get_weather" in client.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=TOOLS)

        async def reply() -> str:
            prompt = {"messages": [{"role": "user", "content": "weather"}], "tools": TOOLS}
            return "".join([out.outputs[0].text async for out in client.generate(prompt, SamplingParams())])

        assert asyncio.run(reply()) == REPLIES["weather"]
    finally:
        client.shutdown()


def test_the_real_engine_reads_replies_as_configured(servers: Servers, chat_model_dir: Path) -> None:
    """The flags through EngineConfig and ModelInfo to the responses: a random model's reply, under deepseek_r1
    (which starts in reasoning), is all reasoning, streamed or not."""
    handle = servers.start(chat_model_dir, served_model_name="tiny-r1", reasoning_parser="deepseek_r1",
                           tool_call_parser="hermes", enable_auto_tool_choice=True)
    kwargs = dict(model="tiny-r1", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=8,
                  temperature=0.0, extra_body={"ignore_eos": True})
    choice = handle.client().chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.model_extra["reasoning"] and choice.message.tool_calls == []
    content, reasoning, calls, finish = _reassemble(list(handle.client().chat.completions.create(stream=True,
                                                                                                 **kwargs)))
    assert (content, reasoning, calls, finish) == ("", choice.message.model_extra["reasoning"], [], "length")
    handle.wait_idle()
