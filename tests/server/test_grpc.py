"""The gRPC service for real: a tiny model in the real AsyncEngine, `start_grpc_server` on a free loopback port, stubs
generated from proto/jengine/v1, grpc.health.v1 and reflection; and `GrpcEngineClient` over it.

Every test that sends requests ends by checking that nothing was lost: no request left in the engine, every KV block
free (the autouse `nothing_leaked` fixture).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import LlamaConfig

from jengine.clients.protocol import EngineClient
from jengine.errors import (
    AuthenticationError, ContextLengthExceededError, InvalidRequestError, RequestTooLargeError,
)
from jengine.outputs import RequestOutput
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import CHATML_TEMPLATE, Tokenizer, train_tiny_tokenizer
from jengine.v1 import jengine_pb2 as pb
from server import grpc_convert
from server.grpc_client import GrpcEngineClient
from tests.conftest import COMMON, TOKENIZER_VOCAB
from tests.server.conftest import paused_core
from tests.server.grpc_fixtures import API_KEY, MAX_MODEL_LEN, GrpcHarness, auth, start_harness, stop_harness, wait_for

GREEDY = pb.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
LONG = pb.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
REPO = Path(__file__).resolve().parents[2]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world! 你好"}]


@pytest.fixture(scope="module")
def harness(build_checkpoint, tmp_path_factory) -> Iterator[GrpcHarness]:
    tokenizer_dir = train_tiny_tokenizer(tmp_path_factory.mktemp("grpc_tokenizer"), vocab_size=TOKENIZER_VOCAB,
                                         chat_template=CHATML_TEMPLATE)
    model_dir, _ = build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=tokenizer_dir)
    harness = start_harness(model_dir)
    yield harness
    stop_harness(harness)


@pytest.fixture(autouse=True)
def nothing_leaked(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "harness" in request.fixturenames:
        harness = request.getfixturevalue("harness")
        assert harness.wait_idle(), "a request or a KV block was left behind"


def _tokenizer(harness: GrpcHarness) -> Tokenizer:
    return harness.engine.get_tokenizer()


def _generate(harness: GrpcHarness, **fields) -> list[pb.GenerateResponse]:
    return list(harness.stub.Generate(pb.GenerateRequest(**fields), metadata=auth(), timeout=30))


def _tokens_and_text(responses: list[pb.GenerateResponse]) -> tuple[list[int], str]:
    return ([t for r in responses for c in r.outputs for t in c.token_ids],
            "".join(c.text for r in responses for c in r.outputs))


def _engine_tokens_and_text(outputs: list[RequestOutput]) -> tuple[list[int], str]:
    choices = [c for o in outputs for c in o.outputs]
    return [t for c in choices for t in c.token_ids], "".join(c.text for c in choices)


def _status(call_fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call_fn()
    return info.value


# ------------------------------------------------------------------------------------------------- wire contract

def test_generated_code_is_current() -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools is not installed")
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    gen_proto = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_proto)
    assert gen_proto.stale_files() == [], "run `python scripts/gen_proto.py` after editing proto/jengine/v1"


def test_sampling_fields_mirror_sampling_params() -> None:
    proto_fields = set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
    # structured_outputs travels as the request's response_format
    assert proto_fields == {f.name for f in dataclasses.fields(SamplingParams)} - {"structured_outputs"}
    grouped = (*grpc_convert.INT_FIELDS, *grpc_convert.FLOAT_FIELDS, *grpc_convert.BOOL_FIELDS,
               *grpc_convert.LIST_FIELDS, *grpc_convert.MAP_FIELDS)
    assert sorted(grouped) == sorted(proto_fields)
    unset = grpc_convert.sampling_from_proto(pb.SamplingParams())
    assert unset == dataclasses.replace(SamplingParams(), max_tokens=None)  # unset max_tokens: what the context leaves
    full = SamplingParams(n=2, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.5,
                          frequency_penalty=-0.5, repetition_penalty=1.2, seed=2**64 - 1, stop=["a", "b"],
                          stop_token_ids=[3], ignore_eos=True, max_tokens=7, min_tokens=1, logprobs=0,
                          prompt_logprobs=3, logit_bias={5: -100.0}, skip_special_tokens=False,
                          spaces_between_special_tokens=False, include_stop_str_in_output=True, detokenize=False)
    back = grpc_convert.sampling_from_proto(grpc_convert.sampling_to_proto(full))
    assert back == dataclasses.replace(full, seed=-1)  # the same seed modulo 2**64, as the engine uses it
    with pytest.raises(InvalidRequestError) as info:
        grpc_convert.sampling_to_proto(SamplingParams(max_tokens=2**40))
    assert info.value.param == "max_tokens"
    for seed in (2**64, -(2**63) - 1):  # no 64 bits carry it: the engine's refusal, not a silently wrapped seed
        with pytest.raises(InvalidRequestError, match=r"seed must be \[") as info:
            grpc_convert.sampling_to_proto(SamplingParams(seed=seed))


# ------------------------------------------------------------------------------------------------- Generate

def test_generate_text_equals_the_engine(harness: GrpcHarness) -> None:
    prompt = "The quick brown fox"
    responses = _generate(harness, text=prompt, sampling=GREEDY, request_id="text-1")
    reference = harness.engine_outputs(prompt, grpc_convert.sampling_from_proto(GREEDY))
    assert _tokens_and_text(responses) == _engine_tokens_and_text(reference)
    assert all(r.request_id == "text-1" for r in responses) and responses[-1].finished
    assert not any(r.finished for r in responses[:-1])
    prompt_ids = _tokenizer(harness).encode(prompt)
    assert list(responses[0].prompt_token_ids) == prompt_ids and responses[0].prompt == prompt
    last = responses[-1]
    assert last.outputs[-1].finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt_ids), 10)


def test_generate_token_ids_and_messages_equal_the_engine(harness: GrpcHarness) -> None:
    ids = _tokenizer(harness).encode("Hello, world! How are you today?")
    responses = _generate(harness, token_ids=pb.TokenIds(ids=ids), sampling=GREEDY)
    reference = harness.engine_outputs({"prompt_token_ids": ids}, grpc_convert.sampling_from_proto(GREEDY))
    assert _tokens_and_text(responses) == _engine_tokens_and_text(reference)
    assert responses[0].request_id and not responses[0].HasField("prompt")  # id made by the server

    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])
    responses = _generate(harness, messages=chat, sampling=GREEDY)
    reference = harness.engine_outputs({"messages": CHAT}, grpc_convert.sampling_from_proto(GREEDY))
    assert _tokens_and_text(responses) == _engine_tokens_and_text(reference)
    assert responses[0].prompt == _tokenizer(harness).apply_chat_template(CHAT)


def test_logprobs_and_choices_stream(harness: GrpcHarness) -> None:
    sampling = pb.SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    responses = _generate(harness, text="Numbers 0123", sampling=sampling)
    per_choice: dict[int, list[pb.TokenLogprob]] = {0: [], 1: []}
    for response in responses:
        for choice in response.outputs:
            per_choice[choice.index].extend(choice.logprobs)
            assert len(choice.logprobs) == len(choice.token_ids)
    for entries in per_choice.values():
        assert len(entries) == 4
        for entry in entries:
            assert [t.rank for t in entry.top_logprobs] == [1, 2, 3]
            assert entry.rank == 1 and entry.top_logprobs[0].token_id == entry.token_id  # greedy: the argmax
    assert responses[-1].usage.completion_tokens == 8


# ------------------------------------------------------------------------------------------------- tokens, model

def test_tokenize_detokenize_round_trip(harness: GrpcHarness) -> None:
    stub, tokenizer = harness.stub, _tokenizer(harness)
    text = "Café, naïve — 日本語 🙂"
    reply = stub.Tokenize(pb.TokenizeRequest(text=text), metadata=auth())
    assert list(reply.token_ids) == tokenizer.encode(text) and reply.count == len(reply.token_ids)
    assert reply.max_model_len == MAX_MODEL_LEN
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=reply.token_ids), metadata=auth()).text == text
    bare = stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=False), metadata=auth())
    assert list(bare.token_ids) == tokenizer.encode(text, add_special_tokens=False)

    chat = stub.Tokenize(pb.TokenizeRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])),
                         metadata=auth())
    assert list(chat.token_ids) == tokenizer.encode_chat(CHAT) and chat.prompt == tokenizer.apply_chat_template(CHAT)
    error = _status(lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=[TOKENIZER_VOCAB]), metadata=auth()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_get_model_info(harness: GrpcHarness) -> None:
    info = harness.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=auth())
    expected = harness.engine.get_model_info()
    assert (info.name, info.max_model_len, info.vocab_size, info.max_logprobs) == (
        expected.name, MAX_MODEL_LEN, TOKENIZER_VOCAB, expected.max_logprobs)
    assert info.tokenizer.has_chat_template and info.tokenizer.eos_token_id == 2 and info.tokenizer.bos_token_id == 1


def test_health_and_reflection_are_open(harness: GrpcHarness) -> None:
    health = health_pb2_grpc.HealthStub(harness.channel)
    for service in ("", "jengine.v1.Engine"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(harness.channel)
    replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"jengine.v1.Engine", "grpc.health.v1.Health"} <= names


# ------------------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("fields, param", [
    (dict(text="hi", sampling=pb.SamplingParams(temperature=-1.0)), "temperature"),
    (dict(text="hi", sampling=pb.SamplingParams(n=0)), "n"),
    (dict(token_ids=pb.TokenIds(ids=[5, TOKENIZER_VOCAB]), sampling=GREEDY), "prompt_token_ids"),
    (dict(token_ids=pb.TokenIds(ids=[5] * MAX_MODEL_LEN), sampling=GREEDY), "prompt"),
    (dict(text="hi", sampling=GREEDY, response_format=pb.ResponseFormat(type="xml")), "response_format"),
    (dict(text="hi", sampling=GREEDY, response_format=pb.ResponseFormat(type="json_schema", json_schema='{"type": 5}')),
     "json_schema"),
    (dict(sampling=GREEDY), "prompt"),
])
def test_bad_requests_are_invalid_argument(harness: GrpcHarness, fields: dict, param: str) -> None:
    error = _status(lambda: _generate(harness, **fields))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert dict(error.trailing_metadata())["jengine-error-param"] == param


def test_an_unknown_lora_name_is_not_found(harness: GrpcHarness) -> None:
    error = _status(lambda: _generate(harness, text="hi", sampling=GREEDY, lora_name="my-adapter"))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "my-adapter" in error.details()


def test_api_key_is_required_except_for_health(harness: GrpcHarness) -> None:
    for metadata in ((), auth("wrong-key"), (("authorization", API_KEY),)):
        error = _status(lambda: harness.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        error = _status(lambda: list(harness.stub.Generate(pb.GenerateRequest(text="hi"), metadata=metadata)))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    health = health_pb2_grpc.HealthStub(harness.channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    lower_case = (("authorization", f"bearer {API_KEY}"),)  # the scheme is case-insensitive, as over HTTP
    assert harness.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=lower_case).max_model_len > 0


def test_an_oversized_message_is_request_too_large_for_the_client(harness: GrpcHarness) -> None:
    """gRPC's own size refusal carries no jengine trailers: the client names it 413-like, never "retry later"."""
    client = GrpcEngineClient(harness.address, api_key=API_KEY)

    async def send() -> None:
        async for _ in client.generate("a " * (3 * 2**20), SamplingParams(max_tokens=1)):
            pass

    try:
        with pytest.raises(RequestTooLargeError):
            asyncio.run(send())
        assert client.get_model_info().max_model_len > 0  # still connected and serving
        local = _tokenizer(harness)
        longest = max(range(local.vocab_size), key=lambda i: len(local.convert_ids_to_tokens([i])[0].encode()))
        entry = len(local.convert_ids_to_tokens([longest])[0].encode()) + 2  # a repeated string's bytes on the wire
        ids = [longest] * (5 * 2**20 // entry)  # token strings over gRPC's 4 MiB default reply size
        assert client.get_tokenizer().convert_ids_to_tokens(ids) == local.convert_ids_to_tokens(ids)
    finally:
        client.shutdown()


def test_queue_full_is_resource_exhausted(harness: GrpcHarness) -> None:
    """The engine admits MAX_NUM_SEQS choices and queues none: a request n=8 fills it."""
    full = harness.stub.Generate(pb.GenerateRequest(text="fill", sampling=pb.SamplingParams(
        n=8, temperature=0.0, max_tokens=200, ignore_eos=True)), metadata=auth())
    next(full)
    error = _status(lambda: _generate(harness, text="one more", sampling=GREEDY))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    full.cancel()


def _warm_up(harness: GrpcHarness, request: pb.GenerateRequest) -> None:
    """Run the start of `request` twice, so the shapes it needs are compiled (CPU tests compile buckets lazily, and a
    step that compiles holds up the abort that follows it for seconds)."""
    for _ in range(2):
        call = harness.stub.Generate(request, metadata=auth())
        _ = [next(call) for _ in range(8)]
        call.cancel()
        assert harness.wait_idle(30.0)


def test_cancel_mid_stream_aborts_and_frees_blocks(harness: GrpcHarness) -> None:
    request = pb.GenerateRequest(text="A long story", sampling=LONG)
    _warm_up(harness, request)
    call = harness.stub.Generate(request, metadata=auth())
    received = [next(call) for _ in range(3)]
    assert harness.engine.num_in_flight == 1 and not received[-1].finished
    call.cancel()
    assert harness.wait_idle(1.0), "cancelling the call must abort the request and free its blocks within 1 s"


def test_deadline_exceeded_aborts_the_request(harness: GrpcHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    request = pb.GenerateRequest(text="A long story", sampling=LONG, request_id="deadline-1")
    _warm_up(harness, request)
    core_loop = harness.engine._core_loop
    aborted: list[str] = []
    abort = core_loop.abort
    monkeypatch.setattr(core_loop, "abort", lambda ids, *args: (aborted.extend(ids), abort(ids, *args)))
    core, step = harness.engine._parts.core, harness.engine._parts.core.step
    # 200 steps of ≥ 10 ms outlast the 0.4 s deadline on any machine (a warm CPU runs this tiny model's in ~2 ms)
    monkeypatch.setattr(core, "step", lambda: (time.sleep(0.01), step())[1])
    received: list[pb.GenerateResponse] = []
    call = harness.stub.Generate(request, metadata=auth(), timeout=0.4)
    error = _status(lambda: received.extend(call))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert received and not received[-1].finished  # cut mid-stream
    assert wait_for(lambda: "deadline-1" in aborted, 1.0), "the deadline must abort the request in the engine"
    assert harness.wait_idle(30.0)  # (a step that compiles a new shape may hold the abort up on the CPU)


def test_deadline_passing_while_queued_aborts_the_request(harness: GrpcHarness) -> None:
    """The core is held, so the call's deadline passes while its request waits: DEADLINE_EXCEEDED, and once the core
    moves again the abort is applied before the request is ever scheduled (no prefix-cache lookup of it)."""
    queries = harness.engine.stats().prefix_cache_queries
    with paused_core(harness.engine):
        call = harness.stub.Generate(pb.GenerateRequest(text="Queued too long", sampling=LONG), metadata=auth(),
                                     timeout=0.5)
        error = _status(lambda: list(call))
        deadline = time.monotonic() + 5  # the server notices the cancelled call and queues the abort ...
        while harness.engine.num_streams and time.monotonic() < deadline:
            time.sleep(0.01)
        assert harness.engine.num_streams == 0
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # ... before the core moves again
    assert harness.wait_idle(5.0)
    assert harness.engine.stats().prefix_cache_queries == queries


def test_draining_refuses_new_calls_and_fails_health(harness: GrpcHarness) -> None:
    server = harness.start_server()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health, stub = health_pb2_grpc.HealthStub(channel), type(harness.stub)(channel)
        assert stub.GetModelInfo(pb.GetModelInfoRequest()).max_model_len == MAX_MODEL_LEN  # no key on this one
        server.set_serving(False)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        error = _status(lambda: list(stub.Generate(pb.GenerateRequest(text="hi", sampling=GREEDY))))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        server.set_serving(True)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    harness.loops.run(server.stop(None))


# ------------------------------------------------------------------------------------------------- GrpcEngineClient

def _merged(outputs: list[RequestOutput]) -> dict:
    """Everything a stream said, per choice, independent of how it was cut into deltas."""
    choices: dict[int, dict] = {}
    for out in outputs:
        for c in out.outputs:
            merged = choices.setdefault(c.index, {"text": "", "token_ids": [], "logprobs": []})
            merged["text"] += c.text
            merged["token_ids"] += c.token_ids
            merged["logprobs"] += c.logprobs or []
            merged.update(finish_reason=c.finish_reason, stop_reason=c.stop_reason, cum=c.cumulative_logprob)
    prompt_logprobs = [e for out in outputs for e in out.prompt_logprobs or []]
    last = outputs[-1]
    return {"choices": choices, "prompt": last.prompt, "prompt_token_ids": last.prompt_token_ids,
            "prompt_logprobs": prompt_logprobs, "finished": [o.finished for o in outputs][-1]}


def test_grpc_engine_client_equals_the_engine(harness: GrpcHarness) -> None:
    client = GrpcEngineClient(harness.address, api_key=API_KEY)
    assert isinstance(client, EngineClient)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=12, logprobs=2, prompt_logprobs=1, stop=["e"])
    continued = {"messages": [*CHAT, {"role": "assistant", "content": "Sure, here"}], "add_generation_prompt": False,
                 "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}}
    prompts = ["The weather is nice", {"prompt": "Hi", "prompt_token_ids": [1, 100, 200]}, {"messages": CHAT},
               continued]

    async def remote(prompt) -> list[RequestOutput]:
        return [out async for out in client.generate(prompt, params)]

    try:
        for prompt in prompts:
            assert _merged(asyncio.run(remote(prompt))) == _merged(harness.engine_outputs(prompt, params))
        info = client.get_model_info()
        assert info == harness.engine.get_model_info()
        tokenizer, local = client.get_tokenizer(), _tokenizer(harness)
        assert tokenizer.encode("Zürich") == local.encode("Zürich") and tokenizer.decode([1, 100, 200]) == \
            local.decode([1, 100, 200])
        assert tokenizer.encode_chat(CHAT) == local.encode_chat(CHAT) and tokenizer.vocab_size == local.vocab_size
        assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=False) == \
            local.apply_chat_template(CHAT, add_generation_prompt=False)
        assert tokenizer.apply_chat_template(continued["messages"], add_generation_prompt=False,
                                             continue_final_message=True, enable_thinking=False) == \
            local.apply_chat_template(continued["messages"], add_generation_prompt=False, continue_final_message=True)
        assert tokenizer.convert_ids_to_tokens([1, 100]) == local.convert_ids_to_tokens([1, 100])
        assert [tokenizer.decode([2], skip_special_tokens=False) for _ in range(2)] == ["</s>", "</s>"]
        assert tokenizer.has_chat_template and tokenizer.eos_token_ids == local.eos_token_ids
        assert client.is_healthy() and client.stats().num_gpu_blocks > 0
    finally:
        client.shutdown()


def test_grpc_engine_client_errors_and_abort(harness: GrpcHarness) -> None:
    client = GrpcEngineClient(harness.address, api_key=API_KEY)

    async def run() -> list[RequestOutput]:
        with pytest.raises(InvalidRequestError) as info:
            _ = [o async for o in client.generate("hi", SamplingParams(temperature=-1.0))]
        assert info.value.param == "temperature"
        with pytest.raises(ContextLengthExceededError):
            _ = [o async for o in client.generate([5] * MAX_MODEL_LEN)]
        outputs = []
        async for out in client.generate("A long story", SamplingParams(temperature=0.0, max_tokens=200,
                                                                        ignore_eos=True), "to-abort"):
            outputs.append(out)
            if len(outputs) == 2:
                await client.abort("to-abort")
        return outputs

    try:
        outputs = asyncio.run(run())
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        assert wait_for(harness.is_idle, 1.0)
        unauthorized = GrpcEngineClient(harness.address, api_key="wrong")
        with pytest.raises(AuthenticationError):
            unauthorized.get_model_info()
        unauthorized.shutdown()
    finally:
        client.shutdown()


def test_openai_shim_runs_over_grpc_engine_client(harness: GrpcHarness, servers) -> None:
    """`jengine openai --engine HOST:PORT`: the real OpenAI app over a GrpcEngineClient, answering like the engine."""
    handle = servers.serve(GrpcEngineClient(harness.address, api_key=API_KEY))
    openai_client = handle.client()
    chat = openai_client.chat.completions.create(model=handle.state.client.get_model_info().name, messages=CHAT,
                                                 temperature=0, max_tokens=8)
    reference = harness.engine_outputs({"messages": CHAT}, SamplingParams(temperature=0, max_tokens=8))
    assert chat.choices[0].message.content == _engine_tokens_and_text(reference)[1]
    completion = openai_client.completions.create(model=chat.model, prompt="Hello", temperature=0, max_tokens=4,
                                                  logprobs=2, echo=True)
    assert len(completion.choices[0].logprobs.tokens) == len(_tokenizer(harness).encode("Hello")) + 4
    assert harness.wait_idle()


# ------------------------------------------------------------------------------------------------- hostile input

USER_HI = pb.ChatMessage(role="user", content="hi")


@pytest.mark.parametrize("chat", [
    pb.ChatMessages(messages=[pb.ChatMessage(role="evil", content="hi")]),  # HTTP refuses this role too
    pb.ChatMessages(messages=[USER_HI], chat_template_kwargs_json="[" * 100_000 + "]" * 100_000),
    pb.ChatMessages(messages=[USER_HI], chat_template_kwargs_json='{"x": ' + "9" * 5000 + "}"),
    pb.ChatMessages(messages=[USER_HI], chat_template_kwargs_json='{"add_generation_prompt": false}'),
    pb.ChatMessages(messages=[USER_HI], chat_template_kwargs_json='{"tools": [{"type": "function"}]}'),
], ids=["role", "deep-kwargs", "huge-number", "colliding-kwarg", "tools-kwarg"])
def test_bad_chat_input_is_invalid_argument(harness: GrpcHarness, chat: pb.ChatMessages) -> None:
    error = _status(lambda: _generate(harness, messages=chat, sampling=GREEDY))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()


def test_an_undecodable_message_is_invalid_argument(harness: GrpcHarness) -> None:
    generate = harness.channel.unary_stream("/jengine.v1.Engine/Generate")  # raw bytes, no serializer
    error = _status(lambda: list(generate(b"\xff\xff\xff\xff", metadata=auth(), timeout=10)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "protobuf" in error.details()
    tokenize = harness.channel.unary_unary("/jengine.v1.Engine/Tokenize")
    assert _status(lambda: tokenize(b"\x0a\xff", metadata=auth(), timeout=10)).code() == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert _generate(harness, text="Hello", sampling=GREEDY)  # still serving

