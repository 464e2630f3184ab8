"""vLLM's periodic stats line in the server's log, one per engine:

`Engine 000: Avg prompt throughput: 96.0 tokens/s, Avg generation throughput: 31.5 tokens/s, Running: 2 reqs,
Waiting: 0 reqs, GPU KV cache usage: 1.2%, Prefix cache hit rate: 40.0%`

Throughputs and the hit rate cover the interval since the previous line; an idle engine logs one line after its last
activity and then stays quiet. The figures are the ones /metrics serves (`EngineMetrics`)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from server.metrics import EngineMetrics

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Totals:
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0


class StatsLogger:
    """Every `interval` seconds, the line above for each engine that did anything since the previous one."""

    def __init__(self, metrics: EngineMetrics, interval: float) -> None:
        self._metrics = metrics
        self._interval = interval
        self._last: dict[str, _Totals] = {}
        self._was_busy: dict[str, bool] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            for line in self.lines(self._interval):
                logger.info("%s", line)

    def lines(self, elapsed: float) -> list[str]:
        """The lines due now, `elapsed` seconds after the previous call (and the totals remembered for the next)."""
        lines = []
        for index, stats in enumerate(self._metrics.snapshots()):
            engine = str(index)
            now = _Totals(self._metrics.sample("prompt_tokens_total", engine),
                          self._metrics.sample("generation_tokens_total", engine),
                          stats.prefix_cache_queries, stats.prefix_cache_hits)
            last = self._last.get(engine, _Totals())
            self._last[engine] = now
            busy = now != last or stats.num_running > 0 or stats.num_waiting > 0
            if not (busy or self._was_busy.get(engine, False)):
                continue
            self._was_busy[engine] = busy
            queries = now.prefix_queries - last.prefix_queries
            hit_rate = 100.0 * (now.prefix_hits - last.prefix_hits) / queries if queries else 0.0
            lines.append(
                f"Engine {index:03d}: Avg prompt throughput: {(now.prompt_tokens - last.prompt_tokens) / elapsed:.1f} "
                f"tokens/s, Avg generation throughput: "
                f"{(now.generation_tokens - last.generation_tokens) / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"GPU KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%")
        return lines
