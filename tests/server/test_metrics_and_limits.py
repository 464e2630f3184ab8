"""The phase histograms (queue, prefill, decode), tokens per engine step, 431 for oversized headers and 504 for a
passed request timeout, against the real engine and app; every test ends with nothing left in the engine.

One engine (one running request at a time, so a second request surely queues) behind two front ends: `plain` with the
default limits, `timed` with a short request timeout (warmed up through `plain`, so no compilation eats its deadline).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from jengine.config import EngineConfig
from jengine.clients.async_engine import AsyncEngine
from tests.server.conftest import (
    ENGINE_KWARGS, MODEL_NAME, ServerHandle, Servers, metric, paused_core, scrape, wait_for,
)

TIMEOUT_S = 1.5
HOLD_S = 0.5  # how long the core is held while both requests wait
STREAM_BODY = {"model": MODEL_NAME, "prompt": "Tell a long story", "max_tokens": 40, "temperature": 0,
               "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(chat_model_dir: Path) -> AsyncEngine:
    config = EngineConfig.from_kwargs(str(chat_model_dir), served_model_name=MODEL_NAME,
                                      **{**ENGINE_KWARGS, "max_num_seqs": 1, "max_num_queued_reqs": 8})
    return AsyncEngine.from_config(config)


@pytest.fixture(scope="module")
def plain(servers: Servers, engine: AsyncEngine) -> Iterator[ServerHandle]:
    handle = servers.serve(engine)
    yield handle
    handle.wait_idle()


@pytest.fixture(scope="module")
def timed(servers: Servers, engine: AsyncEngine, plain: ServerHandle) -> Iterator[ServerHandle]:
    for stream in (False, True):  # compile the shapes the timed requests use, with no deadline
        with plain.http.stream("POST", "/v1/completions", json={**STREAM_BODY, "stream": stream}) as response:
            assert response.status_code == 200
            response.read()
    handle = servers.serve(engine, request_timeout=TIMEOUT_S)
    yield handle
    handle.wait_idle()


def _completion(server: ServerHandle, prompt: str, max_tokens: int) -> httpx.Response:
    return server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True})


# ------------------------------------------------------------------------------------------------- metrics

def test_queue_prefill_decode_and_step_histograms(plain: ServerHandle) -> None:
    before = scrape(plain)
    with paused_core(plain.engine) as release, ThreadPoolExecutor(2) as pool:
        first = pool.submit(_completion, plain, "The first request runs for a while", 12)
        wait_for(lambda: plain.engine.num_in_flight == 1, what="the first request admitted")
        second = pool.submit(_completion, plain, "The second one waits", 1)  # decode time 0: one token
        wait_for(lambda: plain.engine.num_in_flight == 2, what="the second request admitted")
        time.sleep(HOLD_S)
        release()
        responses = [first.result(timeout=60), second.result(timeout=60)]
    plain.wait_idle()
    after = scrape(plain)
    assert [r.status_code for r in responses] == [200, 200]

    def delta(name: str) -> float:
        return metric(after, f"jengine:{name}", engine="0") - metric(before, f"jengine:{name}", engine="0")

    for phase in ("queue", "prefill", "decode"):
        assert delta(f"request_{phase}_time_seconds_count") == 2, phase
    queue, prefill, decode = (delta(f"request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    # Both waited out the hold; the second also waited for the whole first request (one running at a time), whose
    # decode is all the decode time there is.
    assert decode > 0 and queue >= 2 * HOLD_S + decode
    # The engine's phases fit inside what the front end measured around them (one process, one clock).
    assert delta("time_to_first_token_seconds_sum") >= queue + prefill
    assert delta("e2e_request_latency_seconds_sum") >= queue + prefill + decode
    # Tokens per step: the prompts' prefill steps and one decode step per later token (11 for the first request).
    prompts = sum(r.json()["usage"]["prompt_tokens"] for r in responses)
    steps, tokens = delta("iteration_tokens_total_count"), delta("iteration_tokens_total_sum")
    assert steps >= 2 + 11 and tokens >= prompts + 11
    assert metric(after, "jengine:iteration_tokens_total_bucket", engine="0", le="+Inf") == metric(
        after, "jengine:iteration_tokens_total_count", engine="0")


# ------------------------------------------------------------------------------------------------- headers

@pytest.mark.parametrize("headers", [
    {"X-Big": "a" * (70 * 1024)},  # one field over the limit: refused by the parser
    {f"X-Part-{i}": "b" * 4000 for i in range(20)},  # each field small, together over 64 KiB
    {f"X-Many-{i}": "c" for i in range(200)},  # more fields than the parser takes
], ids=["one-field", "many-fields-in-sum", "too-many-fields"])
def test_oversized_headers_get_431_json(plain: ServerHandle, headers: dict[str, str]) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    response = httpx.post(plain.url("/v1/completions"), json=body, headers=headers, timeout=30)
    assert response.status_code == 431 and response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["error"]["code"] == "request_too_large"
    ok = httpx.post(plain.url("/v1/completions"), json=body, headers={"X-Fine": "d" * 8000}, timeout=30)
    assert ok.status_code == 200  # a large but allowed header block passes
    plain.wait_idle()


def test_openai_client_sees_431_as_an_api_error(plain: ServerHandle) -> None:
    client = plain.client(default_headers={"X-Big": "e" * (70 * 1024)})
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    assert caught.value.status_code == 431 and caught.value.body["code"] == "request_too_large"
    plain.wait_idle()


# ------------------------------------------------------------------------------------------------- timeouts

@pytest.mark.parametrize("stream", [False, True])
def test_request_over_the_timeout_gets_504_and_is_aborted(timed: ServerHandle, stream: bool) -> None:
    """The core is held, so the deadline surely passes before the first token: 504 JSON even for a stream."""
    before = scrape(timed)
    with paused_core(timed.engine):
        started = time.monotonic()
        response = timed.http.post("/v1/completions", json={**STREAM_BODY, "stream": stream})
        waited = time.monotonic() - started
    assert response.status_code == 504 and response.json()["error"]["type"] == "timeout"
    assert response.json()["error"]["code"] == "timeout"
    assert TIMEOUT_S <= waited < TIMEOUT_S + 5
    timed.wait_idle(timeout=5.0)
    # Aborted before its first scheduling, once the core moved again: the engine never looked its prompt up.
    queries = "jengine:prefix_cache_queries_total"
    assert metric(scrape(timed), queries, engine="0") == metric(before, queries, engine="0")
    assert _completion(timed, "Still serving", 2).status_code == 200  # the engine keeps serving
    timed.wait_idle()


def test_stream_past_the_timeout_ends_with_an_error_chunk(timed: ServerHandle) -> None:
    """Once the stream has started, the deadline ends it with finish_reason "error", the error object, then [DONE]."""
    core = timed.engine._parts.core
    step = core.step  # ≥ 10 ms a step until the hold (which drops this shadow): the 40 tokens cannot all be out
    core.step = lambda: (time.sleep(0.01), step())[1]  # before it, however fast the machine
    events: list[str] = []
    with timed.http.stream("POST", "/v1/completions", json={**STREAM_BODY, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: ")))  # the stream has begun
        with paused_core(timed.engine):  # no more tokens: the deadline passes mid-stream
            events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["error"]["type"] == "timeout" and last["error"]["code"] == "timeout"
    assert [c["finish_reason"] for c in last["choices"]] == ["error"]
    generated = sum(len(json.loads(e.removeprefix("data: "))["choices"][0]["text"]) > 0 for e in events[:-2])
    assert generated < STREAM_BODY["max_tokens"]  # cut before the end
    timed.wait_idle(timeout=5.0)
