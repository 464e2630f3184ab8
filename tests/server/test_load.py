"""Concurrency, disconnects and metrics against the real engine: batching changes no greedy output, a client that
goes away (queued or mid-stream) leaves nothing behind, and /metrics moves the way vLLM's does."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx

from tests.server.conftest import MODEL_NAME, ServerHandle, metric, paused_core, scrape, wait_for

NUM_STREAMS = 64  # the server fixture admits 8 running + 56 queued: exactly 64 at once


def test_concurrent_greedy_streams_equal_one_by_one(server: ServerHandle) -> None:
    prompts = [f"Prompt number {i}: " + "tell me more " * (i % 5) for i in range(NUM_STREAMS)]
    body = {"model": MODEL_NAME, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        alone = [client.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"]
                 for p in prompts]

    async def stream(client: httpx.AsyncClient, prompt: str) -> str:
        text = ""
        async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def run() -> tuple[list[str], int]:
        limits = httpx.Limits(max_connections=NUM_STREAMS)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as client:
            texts = asyncio.gather(*(stream(client, p) for p in prompts))
            batch = 0
            while not texts.done():  # how full the running batch got: the streams really shared steps
                batch = max(batch, server.engine.stats().num_running)
                await asyncio.sleep(0.002)
            return await texts, batch

    texts, batch = asyncio.run(run())
    assert texts == alone and batch >= 4
    server.wait_idle()


def test_disconnect_mid_stream_aborts_within_a_second(server: ServerHandle) -> None:
    body = {"model": MODEL_NAME, "prompt": "A long story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        streams = [client.stream("POST", "/v1/completions", json=body) for _ in range(6)]
        readers = [stream.__enter__().iter_lines() for stream in streams]  # kept: a dropped reader disconnects
        for lines in readers:
            assert [next(lines).startswith("data: {") for _ in range(6)].count(True) == 3  # 3 events, 3 blank lines
        samples = scrape(server)
        assert metric(samples, "jengine:num_requests_running", engine="0") == 6
        assert server.engine.num_in_flight == 6
        assert metric(samples, "jengine:kv_cache_usage_perc", engine="0") > 0
        for stream in streams:
            stream.__exit__(None, None, None)
    server.wait_idle(timeout=1.0)


def raw_request(server: ServerHandle, path: str, body: dict) -> socket.socket:
    """Send one HTTP/1.1 request on a socket of our own, so the test decides exactly when the client goes away."""
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_disconnect_while_queued_aborts_before_it_runs(server: ServerHandle) -> None:
    before = scrape(server)
    body = {"model": MODEL_NAME, "prompt": "Never scheduled at all", "max_tokens": 50, "stream": True}
    with paused_core(server.engine):
        sock = raw_request(server, "/v1/completions", body)
        wait_for(lambda: server.engine.num_in_flight == 1, what="admission")
        sock.close()  # gone before any token, while the request waits in the core
        wait_for(lambda: server.state.in_flight == 0, what="the handler to end")
    server.wait_idle(timeout=1.0)
    after = scrape(server)  # aborted before its first scheduling: the prefix cache was never even asked
    for name in ("jengine:prefix_cache_queries_total", "jengine:generation_tokens_total"):
        assert metric(after, name, engine="0") == metric(before, name, engine="0"), name


def test_metrics_parse_and_move(server: ServerHandle) -> None:
    before = scrape(server)
    for name in ("jengine:num_requests_running", "jengine:num_requests_waiting", "jengine:kv_cache_usage_perc",
                 "jengine:num_preemptions_total", "jengine:prefix_cache_queries_total",
                 "jengine:prefix_cache_hits_total"):
        assert any(key[0] == name for key in before), name
    assert metric(before, "jengine:num_requests_running", engine="0") == 0
    assert metric(before, "jengine:kv_cache_usage_perc", engine="0") == 0
    body = {"model": MODEL_NAME, "prompt": "Measure me please", "max_tokens": 7, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as response:
        response.read()
    prompt_tokens = len(server.http.post("/tokenize", json={"prompt": body["prompt"]}).json()["tokens"])
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:  # one engine: engine="0"
        return metric(after, name, engine="0", **labels) - metric(before, name, engine="0", **labels)

    assert delta("jengine:prompt_tokens_total") == prompt_tokens
    assert delta("jengine:generation_tokens_total") == 7
    assert delta("jengine:request_success_total", finished_reason="length") == 1
    assert delta("jengine:time_to_first_token_seconds_count") == 1
    assert delta("jengine:inter_token_latency_seconds_count") == 6
    assert delta("jengine:e2e_request_latency_seconds_count") == 1
    assert delta("jengine:e2e_request_latency_seconds_sum") > 0
    assert delta("jengine:prefix_cache_queries_total") >= prompt_tokens
    assert metric(after, "jengine:num_requests_running", engine="0") == 0
    assert metric(after, "jengine:num_requests_waiting", engine="0") == 0
    info = [key for key in after if key[0] == "jengine:cache_config_info"]
    assert info and dict(info[0][1])["block_size"] == "16" and int(dict(info[0][1])["num_gpu_blocks"]) > 0
    assert {dict(labels)["engine"] for name, labels in after if name.startswith("jengine:")
            and name != "jengine:admission_rejections_total"} == {"0"}  # every engine-level series is engine 0's
