"""The soak script's loop (scripts/soak.py) for a few seconds against a real server: every request it sent is
accounted for, the bursts met 429s, and the engine ends idle with nothing leaked."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

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
    assert metrics["fd_growth"] == 0 and metrics["samples"] >= 4
    assert soak.failures(metrics) == []
    server.wait_idle()
