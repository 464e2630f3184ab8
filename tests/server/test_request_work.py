"""One large request cannot stall the server: a 4 MB prompt is parsed and tokenized off the event loop, so `/health`
and a concurrent stream keep answering while it is processed (the server layer's request-work pool). Nor can the
garbage collector: what start-up built is frozen out of its full collections while the server runs."""

from __future__ import annotations

import gc
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, ServerHandle

MAX_GAP_S = 0.25  # the most a stream's next token or /health may wait while the big request is processed
BIG_PROMPT = "ab " * 1_300_000  # 3.9 MB, under the 4 MiB body limit; about 2.6M tokens


def _stream_chunk_times(server: ServerHandle, stop: threading.Event, times: list[list[float]]) -> None:
    """Streams, one after another until `stop`, each with the arrival time of every chunk."""
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        while not stop.is_set():
            arrivals: list[float] = []
            times.append(arrivals)
            body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        arrivals.append(time.monotonic())
                    if stop.is_set():
                        break


def _health_latencies(server: ServerHandle, stop: threading.Event, latencies: list[tuple[float, float]]) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        while not stop.is_set():
            start = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append((start, time.monotonic() - start))
            time.sleep(0.02)


def _max_gap_within(arrivals: list[list[float]], start: float, end: float) -> float:
    """The longest wait between consecutive chunks of one stream that overlaps [start, end]."""
    gaps = [b - a for stream in arrivals for a, b in zip(stream, stream[1:]) if b > start and a < end]
    assert gaps, "no stream was running while the big request was processed"
    return max(gaps)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_4mb_prompt_stalls_neither_health_nor_streams(server: ServerHandle, path: str) -> None:
    stop = threading.Event()
    arrivals: list[list[float]] = []
    latencies: list[tuple[float, float]] = []
    workers = [threading.Thread(target=_stream_chunk_times, args=(server, stop, arrivals)),
               threading.Thread(target=_health_latencies, args=(server, stop, latencies))]
    for worker in workers:
        worker.start()
    try:
        deadline = time.monotonic() + 30
        while not (len(arrivals) >= 2 and len(arrivals[1]) >= 3):  # one whole stream (warm), the next under way
            assert time.monotonic() < deadline, "the stream never started"
            time.sleep(0.01)
        start = time.monotonic()
        big = {"messages": [{"role": "user", "content": BIG_PROMPT}]} if "chat" in path else {"prompt": BIG_PROMPT}
        body = {"model": MODEL_NAME, "max_tokens": 1, **big}
        response = server.http.post(path, json=body)
        end = time.monotonic()
    finally:
        stop.set()
        for worker in workers:
            worker.join(60)
    # parsed, rendered and counted, then refused: it cannot fit the context
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    health_during = [latency for at, latency in latencies if start <= at <= end]
    assert health_during, "no /health probe was sent while the big request was processed"
    assert max(health_during) < MAX_GAP_S, f"/health took {max(health_during):.3f} s ({end - start:.1f} s request)"
    gap = _max_gap_within(arrivals, start, end)
    assert gap < MAX_GAP_S, f"a stream waited {gap:.3f} s for a token during a {end - start:.1f} s request"
    server.wait_idle(5)


def test_start_up_heap_is_out_of_the_collectors_reach_while_serving(server: ServerHandle) -> None:
    """A full collection walks every object it tracks while holding the GIL (0.7 s over a million objects, a stall
    of every stream and of /health): while the server runs, most of the process's objects are frozen, so one walks
    only what was allocated since it started."""
    assert server.http.get("/health").status_code == 200
    assert gc.get_freeze_count() > len(gc.get_objects())
