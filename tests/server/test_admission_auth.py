"""Admission control, auth and the no-chat-template refusal, on a small server: 4 running + 8 queued, an API key,
and a tokenizer without a chat template."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, Servers, ServerHandle, metric, paused_core, scrape

KEY = "sk-test-0123456789"
ALIAS = "tiny-alias"
BURST = 200
BOUND = 4 + 8


@pytest.fixture(scope="module")
def small(servers: Servers, plain_model_dir: Path) -> Iterator[ServerHandle]:
    handle = servers.start(plain_model_dir, api_key=KEY, max_num_seqs=4, max_num_queued_reqs=8,
                           served_model_name=[MODEL_NAME, ALIAS])
    yield handle
    handle.wait_idle()


def test_every_api_route_needs_the_key(small: ServerHandle) -> None:
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        response = small.http.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 401 and response.headers["WWW-Authenticate"].startswith("Bearer")
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.json()["error"]["code"] == "invalid_api_key"
    for path in ("/v1/models", "/tokenize", "/v1/nowhere"):
        assert small.http.request("POST" if path == "/tokenize" else "GET", path).status_code == 401
    assert small.http.post("/v1/completions", json=body, headers=small.headers()).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=small.url("/v1"), api_key="wrong", max_retries=0).models.list()
    assert small.client().models.list().data[0].id == MODEL_NAME


def test_every_served_name_is_accepted_and_the_first_answers(small: ServerHandle) -> None:
    """vLLM's several --served-model-name values: /v1/models lists each, a request may use any."""
    client = small.client()
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    completion = client.completions.create(model=ALIAS, prompt="Hi", max_tokens=2)
    assert completion.model == MODEL_NAME and completion.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi", max_tokens=2)


def test_health_metrics_and_version_are_open(small: ServerHandle) -> None:
    for path in ("/health", "/metrics", "/version", "/ping"):
        assert small.http.get(path).status_code == 200, path
    assert small.http.post("/ping").status_code == 200


def test_browsers_may_call_from_any_origin(small: ServerHandle) -> None:
    """vLLM's default CORS: a preflight is answered without the key; responses, errors and streams carry
    Access-Control-Allow-Origin."""
    origin = {"Origin": "http://app.example"}
    preflight = small.http.options("/v1/chat/completions", headers={
        **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 204 and preflight.headers["Access-Control-Allow-Origin"] == "*"
    assert preflight.headers["Access-Control-Allow-Methods"] == "POST"
    assert preflight.headers["Access-Control-Allow-Headers"] == "authorization"
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
    for headers, status in (({**small.headers(), **origin}, 200), (origin, 401)):
        response = small.http.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == status and response.headers["Access-Control-Allow-Origin"] == "*"
    with small.http.stream("POST", "/v1/completions", json={**body, "stream": True},
                           headers={**small.headers(), **origin}) as stream:
        assert stream.headers["Access-Control-Allow-Origin"] == "*"
        stream.read()
    assert "Access-Control-Allow-Origin" not in small.http.post("/v1/completions", json=body,
                                                                headers=small.headers()).headers


def test_chat_without_a_template_is_a_clear_400(small: ServerHandle) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        small.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}])
    error = caught.value.body
    assert "chat template" in error["message"] and "--chat-template" in error["message"]
    assert error["code"] == "no_chat_template"
    response = small.http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                          headers=small.headers())
    assert response.status_code == 400 and "chat template" in response.json()["error"]["message"]
    small.wait_idle()


def test_a_burst_admits_exactly_the_bound_and_refuses_the_rest_at_once(small: ServerHandle) -> None:
    body = {"model": MODEL_NAME, "prompt": "Burst", "max_tokens": 4, "ignore_eos": True}
    rejections = metric(scrape(small), "jengine:admission_rejections_total", reason="queue_full")

    async def burst(release: Callable[[], None]) -> list[httpx.Response]:
        """All at once while the core is held: the refusals come back, the admitted wait; then release them."""
        limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
        async with httpx.AsyncClient(base_url=small.base_url, headers=small.headers(), limits=limits,
                                     timeout=60) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(BURST)]
            deadline = time.monotonic() + 30
            while sum(t.done() for t in tasks) < BURST - BOUND:
                assert time.monotonic() < deadline, "the refusals did not come back while the core was held"
                await asyncio.sleep(0.01)
            assert small.engine.num_in_flight == BOUND
            assert all(t.result().status_code == 429 for t in tasks if t.done())
            release()
            return await asyncio.gather(*tasks)

    with paused_core(small.engine) as release:
        responses = asyncio.run(burst(release))
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(admitted) == BOUND and len(refused) == BURST - BOUND
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in admitted)
    for response in refused:
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"]["type"] == "rate_limit_error"
        assert response.json()["error"]["code"] == "server_overloaded"
    after = metric(scrape(small), "jengine:admission_rejections_total", reason="queue_full")
    assert after - rejections == BURST - BOUND
    small.wait_idle()
