"""A battery of bad requests: each gets a 4xx with an OpenAI error body naming the problem, and afterwards the server
still answers and the engine holds nothing (no request running or queued, every KV block free)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, ServerHandle

C, H = "/v1/completions", "/v1/chat/completions"
OK_C = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
OK_H = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
USER = [{"role": "user", "content": "Hi"}]


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def c(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in {**OK_C, **fields}.items() if v is not ...}


def h(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in {**OK_H, **fields}.items() if v is not ...}


# (id, method, path, body (dict → JSON, bytes → raw), status, what the error must name: param or message text)
CASES: list[tuple[str, str, str, Any, int, str]] = [
    ("invalid-json", "POST", C, b'{"prompt": ', 400, "not valid JSON"),
    ("json-array-body", "POST", C, b"[1, 2]", 400, "JSON object"),
    ("json-nan", "POST", C, b'{"prompt": "a", "temperature": NaN}', 400, "NaN"),
    ("not-utf8", "POST", C, b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("too-deep", "POST", C, c(metadata={"x": nested(40)}), 400, "nested deeper"),
    ("too-large", "POST", C, c(prompt="a" * (4 * 1024 * 1024 + 10)), 413, "limit"),
    ("no-prompt", "POST", C, c(prompt=...), 400, "prompt"),
    ("empty-prompt", "POST", C, c(prompt=""), 400, "prompt"),
    ("empty-prompt-list", "POST", C, c(prompt=[]), 400, "prompt"),
    ("prompt-number", "POST", C, c(prompt=5), 400, "prompt"),
    ("prompt-mixed", "POST", C, c(prompt=[1, "a"]), 400, "prompt"),
    ("prompt-empty-ids", "POST", C, c(prompt=[[]]), 400, "prompt"),
    ("prompt-bools", "POST", C, c(prompt=[True, False]), 400, "prompt"),
    ("token-id-too-big", "POST", C, c(prompt=[1, 99999]), 400, "prompt_token_ids"),
    ("token-id-negative", "POST", C, c(prompt=[-1]), 400, "prompt_token_ids"),
    ("max-tokens-zero", "POST", C, c(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", "POST", C, c(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-string", "POST", C, c(max_tokens="10"), 400, "max_tokens"),
    ("max-tokens-float", "POST", C, c(max_tokens=1.5), 400, "max_tokens"),
    ("context-exceeded", "POST", C, c(prompt=[5] * 200, max_tokens=100), 400, "max_tokens"),
    ("prompt-too-long", "POST", C, c(prompt=[5] * 300, max_tokens=...), 400, "prompt"),
    ("temperature-negative", "POST", C, c(temperature=-1), 400, "temperature"),
    ("temperature-string", "POST", C, c(temperature="hot"), 400, "temperature"),
    ("top-p-zero", "POST", C, c(top_p=0), 400, "top_p"),
    ("top-p-above-one", "POST", C, c(top_p=1.5), 400, "top_p"),
    ("n-zero", "POST", C, c(n=0), 400, "n"),
    ("n-over-cap", "POST", C, c(n=17), 400, "n"),
    ("n-bool", "POST", C, c(n=True), 400, "n"),
    ("logprobs-over-cap", "POST", C, c(logprobs=21), 400, "logprobs"),
    ("logprobs-negative", "POST", C, c(logprobs=-1), 400, "logprobs"),
    ("65-stops", "POST", C, c(stop=[f"s{i}" for i in range(65)]), 400, "stop"),
    ("stop-number", "POST", C, c(stop=5), 400, "stop"),
    ("stop-empty-string", "POST", C, c(stop=[""]), 400, "stop"),
    ("presence-penalty", "POST", C, c(presence_penalty=3), 400, "presence_penalty"),
    ("frequency-penalty", "POST", C, c(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition-penalty", "POST", C, c(repetition_penalty=0), 400, "repetition_penalty"),
    ("top-k", "POST", C, c(top_k=-2), 400, "top_k"),
    ("min-p", "POST", C, c(min_p=2), 400, "min_p"),
    ("seed-string", "POST", C, c(seed="abc"), 400, "seed"),
    ("seed-too-big", "POST", C, c(seed=2**70), 400, "seed"),
    ("logit-bias-key", "POST", C, c(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit-bias-value", "POST", C, c(logit_bias={"5": 500}), 400, "logit_bias"),
    ("logit-bias-token", "POST", C, c(logit_bias={"99999": 1}), 400, "logit_bias"),
    ("stop-token-id", "POST", C, c(stop_token_ids=[99999]), 400, "stop_token_ids"),
    ("stop-token-ids-string", "POST", C, c(stop_token_ids="1"), 400, "stop_token_ids"),
    ("min-over-max-tokens", "POST", C, c(min_tokens=10, max_tokens=5), 400, "min_tokens"),
    ("ignore-eos-string", "POST", C, c(ignore_eos="yes"), 400, "ignore_eos"),
    ("echo-string", "POST", C, c(echo="yes"), 400, "echo"),
    ("suffix", "POST", C, c(suffix="tail"), 400, "suffix"),
    ("unknown-field", "POST", C, c(frobnicate=1), 400, "frobnicate"),
    ("best-of", "POST", C, c(best_of=2), 400, "best_of"),
    ("truncate-prompt", "POST", C, c(truncate_prompt_tokens=4), 400, "truncate_prompt_tokens"),
    ("completion-no-special-tokens", "POST", C, c(add_special_tokens=False), 400, "add_special_tokens"),
    ("chat-special-tokens", "POST", H, h(add_special_tokens=True), 400, "add_special_tokens"),
    ("chat-echo", "POST", H, h(echo=True), 400, "echo"),
    ("request-id-empty", "POST", C, c(request_id=""), 400, "request_id"),
    ("unknown-model", "POST", C, c(model="gpt-4o"), 404, "gpt-4o"),
    ("stream-string", "POST", C, c(stream="true"), 400, "stream"),
    ("stream-options-without-stream", "POST", C, c(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("stream-options-type", "POST", C, c(stream=True, stream_options={"include_usage": "yes"}), 400,
     "include_usage"),
    ("stream-options-unknown", "POST", C, c(stream=True, stream_options={"foo": True}), 400, "stream_options"),
    ("streamed-prompt-logprobs", "POST", C, c(stream=True, prompt_logprobs=1), 400, "prompt_logprobs"),
    ("chat-no-messages", "POST", H, h(messages=...), 400, "messages"),
    ("chat-empty-messages", "POST", H, h(messages=[]), 400, "messages"),
    ("chat-messages-string", "POST", H, h(messages="hi"), 400, "messages"),
    ("chat-message-number", "POST", H, h(messages=[123]), 400, "messages[0]"),
    ("chat-no-role", "POST", H, h(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    ("chat-unknown-role", "POST", H, h(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    ("chat-tool-role-without-id", "POST", H, h(messages=[{"role": "tool", "content": "x"}]), 400,
     "messages[0].tool_call_id"),
    ("chat-content-number", "POST", H, h(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("chat-image-part", "POST", H, h(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "image_url"),
    ("chat-tool-call-arguments", "POST", H, h(messages=[{"role": "assistant", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), 400,
     "messages[0].tool_calls[0]"),
    ("chat-tool-calls-in-user", "POST", H, h(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400,
     "messages[0].tool_calls"),
    ("chat-tools-auto-not-enabled", "POST", H, h(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "--enable-auto-tool-choice"),
    ("chat-tools-not-functions", "POST", H, h(tools=[{"type": "code_interpreter"}]), 400, "tools[0]"),
    ("chat-tool-no-name", "POST", H, h(tools=[{"type": "function", "function": {"description": "x"}}],
                                        tool_choice="none"), 400, "tools[0].function.name"),
    ("chat-tool-choice-required-without-tools", "POST", H, h(tool_choice="required"), 400, "tool_choice"),
    ("chat-tool-choice-unknown-function", "POST", H, h(
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    ("chat-tool-choice-bad", "POST", H, h(tool_choice="sometimes"), 400, "tool_choice"),
    ("chat-parallel-tool-calls-string", "POST", H, h(parallel_tool_calls="no"), 400, "parallel_tool_calls"),
    ("chat-json-mode", "POST", H, h(response_format={"type": "xml"}), 400, "response_format"),
    ("chat-functions", "POST", H, h(functions=[{"name": "f"}]), 400, "functions"),
    ("chat-audio", "POST", H, h(audio={"voice": "alloy"}), 400, "audio"),
    ("chat-top-logprobs-alone", "POST", H, h(top_logprobs=5), 400, "top_logprobs"),
    ("chat-top-logprobs-cap", "POST", H, h(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("chat-logprobs-int", "POST", H, h(logprobs=3), 400, "logprobs"),
    ("chat-max-completion-tokens", "POST", H, h(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("chat-n-over-cap", "POST", H, h(n=100), 400, "n"),
    ("chat-unknown-model", "POST", H, h(model="llama"), 404, "llama"),
    ("chat-too-long", "POST", H, h(messages=[{"role": "user", "content": "hello " * 300}]), 400, "max_model_len"),
    ("tokenize-empty", "POST", "/tokenize", {}, 400, "prompt"),
    ("detokenize-bad-id", "POST", "/detokenize", {"tokens": [99999]}, 400, "tokens"),
    ("detokenize-string", "POST", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("unknown-route", "GET", "/v1/nope", None, 404, "route"),
    ("wrong-method", "DELETE", "/v1/models", None, 405, "Method Not Allowed"),
]


@pytest.fixture(scope="module")
def http(server: ServerHandle) -> httpx.Client:
    return server.http


@pytest.mark.parametrize(("method", "path", "body", "status", "named"), [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_bad_request_gets_an_openai_error(http: httpx.Client, method: str, path: str, body: Any, status: int,
                                          named: str) -> None:
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    response = http.request(method, path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and 0 < len(error["message"]) <= 500
    assert isinstance(error["type"], str) and isinstance(error["code"], str)
    assert named == error["param"] or named in error["message"], error
    assert "/tmp" not in error["message"] and "Traceback" not in error["message"]


def test_battery_is_large_enough() -> None:
    assert len(CASES) >= 50 and len({case[0] for case in CASES}) == len(CASES)


def test_server_still_answers_and_holds_nothing(server: ServerHandle, http: httpx.Client) -> None:
    response = http.post(C, json={**OK_C, "max_tokens": 3})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    server.wait_idle()
