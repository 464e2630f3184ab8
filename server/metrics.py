"""Prometheus metrics with vLLM's names and meanings (`jengine:` prefix), one registry per server instance.

Two sources, so the core thread does no metric work beyond publishing one snapshot per step:
- gauges and the core's cumulative counters (running, waiting, KV usage, preemptions, prefix-cache tokens) are read at
  scrape time from `EngineClient.stats()`, the snapshot the core publishes after each step; so is the tokens-per-step
  histogram, as the cumulative bucket counts the core keeps;
- per-request figures (tokens, TTFT, inter-token latency, end-to-end latency, finish reasons) are recorded by
  `MeteredEngineClient`, an `EngineClient` that wraps another and watches the outputs pass. `jengine serve` hands the
  wrapped client to both front ends, so HTTP and gRPC traffic is counted alike. The phase times (queue, prefill,
  decode) come from the core's own timestamps on the outputs; a client whose outputs carry none (a remote engine over
  gRPC) records no phase samples rather than estimates.
No global registry: several servers can live in one process (tests do).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from jengine.clients.protocol import EngineClient, ModelInfo
from jengine.engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats
from jengine.front.input_processor import PromptInput
from jengine.errors import CapacityError
from jengine.outputs import RequestOutput
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PREFIX = "jengine:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # also the queue, prefill and decode phases (vLLM's request latency)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _EngineStatsCollector(Collector):
    """Turns `client.stats()` into gauges and counters when Prometheus scrapes."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self._client = client
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._client.stats()
        except Exception:  # a remote engine that cannot answer now: serve the request-level metrics anyway
            logger.warning("engine stats unavailable for /metrics", exc_info=True)
            return
        yield from self._gauges(stats)
        yield from self._counters(stats)
        yield from self._iteration_tokens(stats)

    def _gauges(self, stats: EngineStats) -> Iterator[Metric]:
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", stats.kv_cache_usage),
        ):
            yield self._family(GaugeMetricFamily, name, doc, value)
        info = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the KV cache.",
                                 labels=["block_size", "num_gpu_blocks", "model_name"])
        info.add_metric([str(stats.block_size), str(stats.num_gpu_blocks), self._model], 1.0)
        yield info

    def _counters(self, stats: EngineStats) -> Iterator[Metric]:
        for name, doc, value in (
            ("num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions),
            ("prefix_cache_queries", "Prefix-cache queries, in tokens.", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix-cache hits, in tokens.", stats.prefix_cache_hits),
        ):
            yield self._family(CounterMetricFamily, name, doc, value)

    def _iteration_tokens(self, stats: EngineStats) -> Iterator[Metric]:
        """The core's per-step token histogram (nothing when the engine does not report one)."""
        if not stats.step_token_counts:
            return
        cumulative = list(itertools.accumulate(stats.step_token_counts))
        buckets = [(str(float(bound)), count) for bound, count in zip(ITERATION_TOKEN_BUCKETS, cumulative)]
        family = HistogramMetricFamily(PREFIX + "iteration_tokens_total", "Tokens computed per engine step.",
                                       labels=["model_name"])
        family.add_metric([self._model], buckets + [("+Inf", cumulative[-1])], sum_value=stats.step_tokens_sum)
        yield family

    def _family(self, cls: type, name: str, doc: str, value: float) -> Metric:
        family = cls(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family


class EngineMetrics:
    """The registry of one server, with the request-level metrics recorded by `MeteredEngineClient`."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generation tokens processed.").labels(model_name)
        self._success = counter("request_success", "Finished requests, by finish reason.", ("finished_reason",))
        self._rejections = counter("admission_rejections", "Requests refused at admission, by reason.", ("reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive output tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    E2E_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from first scheduling to first token.",
                                      E2E_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Time from first token to last token.",
                                     E2E_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per request.",
                                                   TOKEN_BUCKETS)
        self.registry.register(_EngineStatsCollector(client, model_name))

    def record_finish(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def record_rejection(self, reason: str) -> None:
        self._rejections.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of everything (counter samples carry `_total`)."""
        return generate_latest(self.registry)


class _RequestTracker:
    """Per-request bookkeeping between outputs: which choices finished, when the previous token arrived."""

    def __init__(self, metrics: EngineMetrics, n: int) -> None:
        self._metrics = metrics
        self._n = n
        self._finished: set[int] = set()
        self._num_generated = 0
        self._num_prompt: int | None = None
        self._last_token_at: float | None = None
        # This process's clock, at the call (admission follows at once): a remote engine's times are not comparable.
        self._arrival = time.monotonic()

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        if self._num_prompt is None:
            self._num_prompt = len(output.prompt_token_ids)
            self._metrics.prompt_tokens.inc(self._num_prompt)
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        if new_tokens:
            self._observe_tokens(new_tokens, now)
        for choice in output.outputs:
            if choice.finish_reason is not None and choice.index not in self._finished:
                self._finished.add(choice.index)
                self._metrics.record_finish(choice.finish_reason)
        if output.finished:
            self._observe_end(output, now)

    def _observe_tokens(self, new_tokens: int, now: float) -> None:
        self._metrics.generation_tokens.inc(new_tokens)
        if self._last_token_at is None:
            self._metrics.ttft.observe(max(0.0, now - self._arrival))
        else:
            self._metrics.itl.observe(now - self._last_token_at)
        self._last_token_at = now
        self._num_generated += new_tokens

    def _observe_end(self, output: RequestOutput, now: float) -> None:
        self._metrics.e2e.observe(max(0.0, now - self._arrival))
        self._metrics.request_prompt_tokens.observe(self._num_prompt or 0)
        self._metrics.request_generation_tokens.observe(self._num_generated)
        self._observe_phases(output)

    def _observe_phases(self, output: RequestOutput) -> None:
        """Queue, prefill and decode times on the engine's clock, each where the engine reported both ends."""
        times = output.metrics
        if times is None or times.first_scheduled_time is None:
            return  # never scheduled, or an engine that reports no scheduling times: no sample beats a guess
        for histogram, value in ((self._metrics.queue_time, times.queue_time),
                                 (self._metrics.prefill_time, times.prefill_time),
                                 (self._metrics.decode_time, times.decode_time)):
            if value is not None:
                histogram.observe(max(0.0, value))

    def close(self, reason: str = "abort") -> None:
        """The stream ended early (caller gone: "abort"; engine failure: "error"): unfinished choices count so."""
        if self._num_prompt is None:
            return  # never admitted (or failed before any output): not a request the engine served
        for _ in range(self._n - len(self._finished)):
            self._metrics.record_finish(reason)
        self._finished = set(range(self._n))


class MeteredEngineClient:
    """An `EngineClient` that records request-level metrics of everything streamed through it."""

    def __init__(self, inner: EngineClient, metrics: EngineMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    async def generate(self, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """The inner stream, unchanged; closing this generator closes (and so aborts) the inner one."""
        params = sampling_params or SamplingParams()
        tracker = _RequestTracker(self.metrics, params.n if isinstance(params.n, int) else 1)
        reason = "abort"
        try:
            async with aclosing(self.inner.generate(prompt, params, request_id, priority=priority)) as stream:
                async for output in stream:
                    tracker.observe(output)
                    yield output
        except CapacityError:
            self.metrics.record_rejection("queue_full")
            raise
        except Exception:
            reason = "error"
            raise
        finally:
            tracker.close(reason)

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    def get_tokenizer(self) -> Tokenizer:
        return self.inner.get_tokenizer()

    def get_model_info(self) -> ModelInfo:
        return self.inner.get_model_info()

    def is_healthy(self) -> bool:
        return self.inner.is_healthy()

    def stats(self) -> EngineStats:
        return self.inner.stats()

    def shutdown(self) -> None:
        self.inner.shutdown()
