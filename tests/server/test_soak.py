"""The soak script's loop (scripts/soak.py) for a few seconds against a real server: every request it sent is
accounted for, the bursts met 429s, and the engine ends idle with nothing leaked."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import soak  # noqa: E402
import soak_traffic  # noqa: E402

from tests.server.conftest import MODEL_NAME, Servers  # noqa: E402


def test_a_short_soak_accounts_for_every_request(servers: Servers, chat_model_dir: Path) -> None:
    server = servers.start(chat_model_dir, max_num_seqs=2, max_num_queued_reqs=2)  # bursts of 10 meet 429s
    settings = soak.SoakSettings(duration=5, warmup=1, concurrency=3, burst=10, burst_interval=1,
                                 sample_interval=0.5, request_timeout=60)
    target = soak_traffic.Target(MODEL_NAME, max_prompt_words=12, max_tokens=12)
    metrics = asyncio.run(soak.run_soak(server.base_url, os.getpid(), settings, target))
    counts = metrics["counts"]
    assert counts["sent"] == counts["ok"] + counts["refused"] + counts["cancelled"] + counts["errored"]
    assert metrics["lost_requests"] == 0 and counts["errored"] == 0, counts["error_samples"]
    assert counts["ok"] and counts["cancelled"] and counts["by_kind"]["burst"].get("refused")
    assert counts["by_kind"]["bad_input"]["refused"] == sum(counts["by_kind"]["bad_input"].values())
    assert metrics["kv_usage_end"] == metrics["running_end"] == metrics["waiting_end"] == 0
    # no descriptor leaked (fewer at the end is fine: this test process also closes what earlier tests opened);
    # RSS is not checked here: this process also compiles the steps
    assert metrics["fd_growth"] <= 0 and metrics["samples"] >= 4
    server.wait_idle()


def test_the_soak_reads_sse_lines_as_sse_splits_them() -> None:
    """A model's text may hold U+2028 or U+0085 raw inside a chunk's JSON: that is one SSE line, not two."""
    text = '{"choices":[{"text":"a\u2028b\x85c","finish_reason":"length"}]}'

    async def body() -> AsyncIterator[bytes]:
        for part in (f"data: {text}\r\n\r\n".encode(), b"data: [DO", b"NE]\n\n"):
            yield part

    async def read() -> tuple[str, str]:
        return await soak_traffic.read_stream(httpx.Response(200, content=body()))

    assert asyncio.run(read()) == ("ok", "")
