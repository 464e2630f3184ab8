"""The published vLLM and SGLang advisories that apply to an HTTP/gRPC front end, replayed: each class of attack as a
request, with the status it must get. After all of them the server still answers and holds nothing.

Classes: chat-template injection (Jinja in content, template arguments smuggled through chat_template_kwargs),
unbounded fan-out (n, logprobs, prompt_logprobs, stop lists), empty prompts, huge headers, out-of-range token ids,
deep JSON, oversized and compressed bodies (a gzip bomb), numbers no parser should convert, and invalid Unicode."""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, ServerHandle

C, H = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]


def c(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **fields}).encode()


def h(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL_NAME, "messages": USER, "max_tokens": 2, **fields}).encode()


def deep(depth: int) -> bytes:
    return b'{"prompt": "a", "metadata": ' + b"[" * depth + b"]" * depth + b"}"


GZIP_BOMB = gzip.compress(b"0" * (64 * 1024 * 1024), compresslevel=9)  # 64 MiB of zeros in about 64 KB

# (advisory class, path, raw body, extra headers, status it must get)
ADVISORIES: list[tuple[str, str, bytes, dict[str, str], int]] = [
    ("template-injection-kwarg-chat-template", H, h(chat_template_kwargs={"chat_template": "{{ 7 * 7 }}"}), {}, 400),
    ("template-injection-kwarg-tools", H, h(chat_template_kwargs={"tools": [{"type": "function"}]}), {}, 400),
    ("template-injection-kwarg-messages", H, h(chat_template_kwargs={"messages": []}), {}, 400),
    ("template-injection-kwarg-helper", H, h(chat_template_kwargs={"raise_exception": 1}), {}, 400),
    ("template-injection-jinja-in-content", H, h(messages=[{"role": "user", "content":
                                                            "{{ ''.__class__.__mro__ }}{% for x in range(9**9) %}"}]),
     {}, 200),
    ("unbounded-n", C, c(n=1_000_000), {}, 400),
    ("unbounded-n-chat", H, h(n=10_000), {}, 400),
    ("unbounded-logprobs", C, c(logprobs=1_000_000), {}, 400),
    ("unbounded-top-logprobs", H, h(logprobs=True, top_logprobs=100_000), {}, 400),
    ("unbounded-prompt-logprobs", C, c(prompt_logprobs=100_000), {}, 400),
    ("unbounded-prompt-logprobs-fanout", C, c(prompt=[[5] * 200] * 4, n=16, echo=True, logprobs=20, max_tokens=1),
     {}, 400),
    ("unbounded-stop-strings", C, c(stop=[f"s{i}" for i in range(10_000)]), {}, 400),
    ("unbounded-stop-token-ids", C, c(stop_token_ids=[1] * 100_000), {}, 400),
    ("unbounded-logit-bias", C, c(logit_bias={str(i): 1 for i in range(5000)}), {}, 400),
    ("unbounded-max-tokens", C, c(max_tokens=10**9), {}, 400),
    ("batch-never-admissible", C, c(prompt=["a"] * 100, n=16), {}, 400),
    ("empty-prompt", C, c(prompt=""), {}, 400),
    ("empty-prompt-list", C, c(prompt=[]), {}, 400),
    ("empty-token-prompt", C, c(prompt=[[]]), {}, 400),
    ("empty-messages", H, h(messages=[]), {}, 400),
    ("token-id-vocab", C, c(prompt=[1, 10**6]), {}, 400),
    ("token-id-negative", C, c(prompt=[-1]), {}, 400),
    ("token-id-int64-overflow", C, c(prompt=[2**63]), {}, 400),
    ("detokenize-out-of-range", "/detokenize", json.dumps({"tokens": [10**12]}).encode(), {}, 400),
    ("logit-bias-out-of-range", C, c(logit_bias={"99999999": 5}), {}, 400),
    ("stop-token-out-of-range", C, c(stop_token_ids=[-1]), {}, 400),
    ("deep-json", C, deep(100_000), {}, 400),
    ("deep-json-under-body-limit", C, deep(40), {}, 400),
    ("huge-int-seed", C, b'{"prompt": "a", "max_tokens": 2, "seed": ' + b"1" * 10_000 + b"}", {}, 400),
    ("lone-surrogate", C, b'{"prompt": "\\ud83d", "max_tokens": 2}', {}, 400),
    ("body-over-limit", C, c(prompt="a" * (5 * 1024 * 1024)), {}, 413),
    ("gzip-bomb", C, GZIP_BOMB, {"Content-Encoding": "gzip"}, 413),
    ("gzip-lie", C, b"\x1f\x8b not really gzip", {"Content-Encoding": "gzip"}, 400),
    ("huge-header", "/v1/models", b"", {"X-Pad": "a" * 100_000}, 431),
    ("many-headers", "/v1/models", b"", {f"X-H{i}": "v" for i in range(300)}, 431),
]


@pytest.mark.parametrize(("path", "raw", "headers", "status"), [case[1:] for case in ADVISORIES],
                         ids=[case[0] for case in ADVISORIES])
def test_advisory_replay_gets_its_status(server: ServerHandle, path: str, raw: bytes, headers: dict[str, str],
                                         status: int) -> None:
    method = "GET" if path == "/v1/models" else "POST"
    try:
        response = server.http.request(method, path, content=raw or None,
                                       headers={"Content-Type": "application/json", **headers})
    except (httpx.RemoteProtocolError, httpx.ReadError):  # a header block refused and the socket closed mid-send
        assert status == 431
        return
    assert response.status_code == status, response.text[:300]
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in error["message"]


def test_the_jinja_in_content_is_text_not_code(server: ServerHandle) -> None:
    content = "{{ 7 * 7 }}"
    response = server.http.post("/tokenize", json={"messages": [{"role": "user", "content": content}]})
    assert response.status_code == 200
    decoded = server.http.post("/detokenize", json={"tokens": response.json()["tokens"]}).json()["prompt"]
    assert content in decoded and "49" not in decoded


def test_after_the_replay_the_server_answers_and_holds_nothing(server: ServerHandle) -> None:
    assert server.http.get("/health").status_code == 200
    assert server.http.post(C, json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    server.wait_idle(5)
