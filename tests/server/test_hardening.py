"""Inputs that once reached a 500, a corrupted stream, a retry-forever 429 or an unbounded response: each now gets a
clear 4xx with the OpenAI error body (or a well-formed SSE ending), and the server holds nothing afterwards."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from jengine.config import EngineConfig, ServerConfig
from jengine.clients.async_engine import AsyncEngine
from server.http_limits import KEEPALIVE_SECONDS
from tests.server.conftest import ENGINE_KWARGS, MODEL_NAME, ServerHandle, Servers, ServerThread, paused_core

C, H = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]


def _post_raw(http: httpx.Client, path: str, raw: bytes, **headers: str) -> httpx.Response:
    return http.post(path, content=raw, headers={"Content-Type": "application/json", **headers})


def assert_openai_error(response: httpx.Response, status: int, named: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["code"], str)
    assert named == error["param"] or named in error["message"], error
    return error


# (id, path, raw JSON body, what the 400 must name)
BAD_BODIES: list[tuple[str, str, bytes, str]] = [
    *[(f"template-kwarg-{key}", H, json.dumps({"messages": USER, "max_tokens": 2, "chat_template_kwargs": {
        key: value}}).encode(), "chat_template_kwargs")
      for key, value in [("add_generation_prompt", True), ("messages", []), ("continue_final_message", True),
                         ("tokenize", True), ("tools", [{"type": "function", "function": {"name": "f"}}]),
                         ("raise_exception", "x")]],
    ("surrogate-prompt", C, b'{"prompt": "a\\ud800b", "max_tokens": 2}', "surrogate"),
    ("surrogate-content", H, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
     "surrogate"),
    ("surrogate-key", C, b'{"prompt": "a", "max_tokens": 2, "metadata": {"\\ud800": 1}}', "surrogate"),
    ("surrogate-stream-request-id", C, b'{"prompt": "hi", "max_tokens": 2, "stream": true, "request_id": '
                                       b'"y\\ud800"}', "surrogate"),
    ("5000-digit-seed", C, b'{"prompt": "a", "max_tokens": 2, "seed": ' + b"9" * 5000 + b"}", "number"),
    ("superscript-logit-bias-key", C, b'{"prompt": "a", "max_tokens": 2, "logit_bias": {"\xc2\xb2": 1}}',
     "logit_bias"),
    ("long-logit-bias-key", C, b'{"prompt": "a", "max_tokens": 2, "logit_bias": {"' + b"9" * 5000 + b'": 1}}',
     "logit_bias"),
    ("many-stop-token-ids", C, json.dumps({"prompt": "a", "max_tokens": 2, "stop_token_ids": [1] * 2000}).encode(),
     "stop_token_ids"),
    ("tokenize-template-kwarg", "/tokenize", json.dumps({"messages": USER, "chat_template_kwargs": {
        "add_generation_prompt": False}}).encode(), "chat_template_kwargs"),
]


@pytest.mark.parametrize(("path", "raw", "named"), [case[1:] for case in BAD_BODIES],
                         ids=[case[0] for case in BAD_BODIES])
def test_malformed_input_is_a_400(server: ServerHandle, path: str, raw: bytes, named: str) -> None:
    assert_openai_error(_post_raw(server.http, path, raw), 400, named)


def test_after_the_battery_the_server_answers_and_holds_nothing(server: ServerHandle) -> None:
    assert server.http.post(C, json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    server.wait_idle()


def test_a_body_that_is_not_the_gzip_it_claims_is_a_400(server: ServerHandle) -> None:
    response = _post_raw(server.http, C, b"this is not gzip at all", **{"Content-Encoding": "gzip"})
    assert_openai_error(response, 400, "Content-Encoding")
    good = gzip.compress(json.dumps({"prompt": "Hi", "max_tokens": 2}).encode())
    assert _post_raw(server.http, C, good, **{"Content-Encoding": "gzip"}).status_code == 200


def test_a_batch_that_can_never_be_admitted_is_a_400_and_holds_no_slot(server: ServerHandle) -> None:
    # the engine holds 8 running + 56 queued = 64 sequences; 5 prompts × n=16 = 80 could never be admitted
    response = server.http.post(C, json={"prompt": ["a", "b", "c", "d", "e"], "n": 16, "max_tokens": 2})
    error = assert_openai_error(response, 400, "prompt")
    assert "never be admitted" in error["message"] and "Retry-After" not in response.headers
    assert server.engine.num_in_flight == 0
    assert server.http.post(C, json={"prompt": ["a"] * 4, "n": 16, "max_tokens": 1}).status_code == 200
    server.wait_idle()


def test_unbounded_prompt_logprob_work_is_refused_naming_the_fields(server: ServerHandle) -> None:
    prompts = [[5] * 200] * 4  # 4 × n=16 × 200 tokens × (20 + 1) = 268,800 logprob entries
    response = server.http.post(C, json={"prompt": prompts, "n": 16, "echo": True, "logprobs": 20, "max_tokens": 1})
    error = assert_openai_error(response, 400, "prompt_logprobs")
    assert "n × prompt tokens" in error["message"]
    small = server.http.post(C, json={"prompt": [5] * 20, "n": 2, "echo": True, "logprobs": 2, "max_tokens": 1})
    assert small.status_code == 200 and len(small.json()["choices"]) == 2
    server.wait_idle()


@pytest.fixture(scope="module")
def keyed(servers: Servers, chat_model_dir: Path) -> ServerHandle:
    return servers.start(chat_model_dir, api_key="sk-right")


def test_non_utf8_bytes_in_the_authorization_header_are_a_401(keyed: ServerHandle) -> None:
    response = keyed.http.get("/v1/models", headers={"Authorization": b"Bearer \xff\xfe\x80"})
    assert_openai_error(response, 401, "API key")
    assert keyed.http.get("/v1/models", headers={"Authorization": "Bearer sk-right"}).status_code == 200


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes the connection (recv returns b"") within `seconds`; response bytes are skipped."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if sock.recv(65536) == b"":
                return True
    except TimeoutError:
        return False
    return False


def test_idle_and_slow_header_connections_are_closed_after_the_keepalive(server: ServerHandle) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    idle = socket.create_connection((host, int(port)))
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # answered, then the connection idles
    trickle = socket.create_connection((host, int(port)))
    trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # a head that never completes
    results: dict[str, bool] = {}
    threads = [threading.Thread(target=lambda s=s, k=k: results.__setitem__(k, _closed_within(s, KEEPALIVE_SECONDS
                                                                                              + 3)))
               for k, s in (("idle", idle), ("trickle", trickle))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    idle.close()
    trickle.close()
    assert results == {"idle": True, "trickle": True}


def test_a_stream_cut_at_the_drain_timeout_ends_with_an_error_chunk_and_done(chat_model_dir: Path) -> None:
    config = EngineConfig.from_kwargs(str(chat_model_dir), served_model_name=MODEL_NAME, **ENGINE_KWARGS)
    thread = ServerThread(AsyncEngine.from_config(config), ServerConfig(host="127.0.0.1", port=0, grpc_port=0))
    handle = thread.start()
    payloads: list[str] = []
    drain = None
    try:
        body = {"prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=handle.base_url, timeout=30) as http, http.stream("POST", C, json=body) as response, \
                paused_core(thread.engine):
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    payloads.append(line[6:])
                if payloads and drain is None:  # held mid-stream; the drain times out on it
                    drain = asyncio.run_coroutine_threadsafe(thread._server.drain(0.2), thread.loop)
        assert drain is not None
        drain.result(10)
    finally:
        thread.stop()
    assert payloads[-1] == "[DONE]", payloads[-3:]
    last = json.loads(payloads[-2])
    assert last["choices"][0]["finish_reason"] == "error" and last["error"]["type"] == "service_unavailable_error"
