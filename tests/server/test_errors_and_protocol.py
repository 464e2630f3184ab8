"""The one error table and the request parser, without a server: statuses, gRPC codes, sanitised messages, and what
the parser accepts, refuses and turns into SamplingParams."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from jengine.clients.protocol import ModelInfo
from jengine.errors import (
    AuthenticationError, CapacityError, ContextLengthExceededError, DeadlineExceededError, EngineDeadError,
    InvalidRequestError, NotFoundError, RequestTooLargeError, ServiceUnavailableError,
)
from jengine.tokenizer import NoChatTemplateError
from server.errors import (
    MAX_MESSAGE_CHARS, HeadersTooLargeError, grpc_status, http_headers, http_status, openai_error, openai_error_body,
)
from server.openai.protocol import normalize_messages, parse_chat, parse_completion

INFO = ModelInfo("m", "/models/m", 256, 384, 20)


@pytest.mark.parametrize(("error", "status", "type_", "code", "grpc_code"), [
    (InvalidRequestError("bad", param="n"), 400, "invalid_request_error", "invalid_value", "INVALID_ARGUMENT"),
    (ContextLengthExceededError("long"), 400, "invalid_request_error", "context_length_exceeded",
     "INVALID_ARGUMENT"),
    (RequestTooLargeError("big"), 413, "invalid_request_error", "request_too_large", "RESOURCE_EXHAUSTED"),
    (HeadersTooLargeError("headers"), 431, "invalid_request_error", "request_too_large", "RESOURCE_EXHAUSTED"),
    (AuthenticationError("key"), 401, "authentication_error", "invalid_api_key", "UNAUTHENTICATED"),
    (NotFoundError("model"), 404, "invalid_request_error", "model_not_found", "NOT_FOUND"),
    (CapacityError("full"), 429, "rate_limit_error", "server_overloaded", "RESOURCE_EXHAUSTED"),
    (ServiceUnavailableError("draining"), 503, "service_unavailable_error", "service_unavailable", "UNAVAILABLE"),
    (EngineDeadError("dead"), 503, "service_unavailable_error", "service_unavailable", "UNAVAILABLE"),
    (DeadlineExceededError("late"), 504, "timeout", "timeout", "DEADLINE_EXCEEDED"),
    (asyncio.CancelledError(), 499, "cancelled", "cancelled", "CANCELLED"),
    (KeyError("secret"), 500, "internal_error", "internal_error", "INTERNAL"),
])
def test_one_table_for_http_statuses_openai_types_and_rpc_codes(error: BaseException, status: int, type_: str, code: str,
                                            grpc_code: str) -> None:
    body = openai_error_body(error)["error"]
    assert (http_status(error), body["type"], body["code"]) == (status, type_, code)
    assert grpc_status(error) == getattr(grpc.StatusCode, grpc_code)


def test_error_bodies_are_bounded_and_sanitised() -> None:
    leaky = InvalidRequestError("cannot read /home/user/models/llama/config.json\x00" + "x" * 2000, param="prompt")
    error = openai_error(leaky)
    assert "/home" not in error["message"] and "<path>" in error["message"] and "\x00" not in error["message"]
    assert len(error["message"]) <= MAX_MESSAGE_CHARS and error["param"] == "prompt"
    bug = openai_error(RuntimeError("object at 0x7f00 with token sk-secret"))
    assert bug["message"] == "internal server error (RuntimeError); see the server log"
    assert openai_error(NoChatTemplateError())["code"] == "no_chat_template"
    assert http_headers(CapacityError("full"))["Retry-After"] == "1"
    assert "Bearer" in http_headers(AuthenticationError("no"))["WWW-Authenticate"]


def test_completion_defaults_extras_and_harmless_fields() -> None:
    parsed = parse_completion({"prompt": "hi", "user": "u", "metadata": {"a": "b"}, "store": False,
                               "service_tier": "auto", "top_k": -1, "min_p": 0.1, "stop": "x",
                               "logit_bias": {"5": 1.5}, "seed": 3, "echo": True, "logprobs": 2}, INFO)
    params = parsed.params
    assert params.max_tokens == 16 and parsed.prompts == ["hi"]  # omitted: vLLM's default for completions
    assert (params.top_k, params.min_p, params.stop, params.logit_bias, params.seed) == (0, 0.1, ("x",), {5: 1.5}, 3)
    assert params.logprobs == 2 and params.prompt_logprobs == 2  # echo shows the prompt's logprobs too
    assert parse_completion({"prompt": [[1, 2], [3]]}, INFO).prompts == [{"prompt_token_ids": [1, 2]},
                                                                         {"prompt_token_ids": [3]}]
    integral = parse_completion({"prompt": "hi", "max_tokens": 3.0, "n": 2.0, "temperature": 1.0}, INFO).params
    assert (integral.max_tokens, integral.n) == (3, 2) and type(integral.max_tokens) is int  # 3.0 is 3, 1.5 a 400


def test_chat_parsing() -> None:
    parsed = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]}],
                         "max_tokens": 9, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3,
                         "tool_choice": "none", "tools": [], "response_format": {"type": "text"},
                         "parallel_tool_calls": False, "stream": True, "stream_options": {"include_usage": True}},
                        INFO)
    assert parsed.prompt == {"messages": [{"role": "user", "content": "a\nb"}], "add_generation_prompt": True}
    assert parsed.params.max_tokens == 5 and parsed.params.logprobs == 3 and parsed.top_logprobs == 3
    assert parsed.stream and parsed.stream_options.include_usage
    assert normalize_messages([{"role": "developer", "content": "x", "name": "n"}]) == [
        {"role": "developer", "content": "x", "name": "n"}]
    with pytest.raises(InvalidRequestError, match="n must be"):
        parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 17}, INFO)
