"""Prometheus metrics with vLLM's names and meanings (`jengine:` prefix; `vllm:` or both with `metrics_prefix`), one
registry per server instance; and the log line of each finished request.

Every engine-level series carries the label `engine="0"`..`"N-1"` (the data-parallel router's replicas in order; a
single engine is `engine="0"`), as vLLM labels its engines; there is no unlabelled total beside them (a PromQL `sum()`
makes it, and both would double-count). Two sources, so the core thread does no metric work beyond publishing one
snapshot per step:
- gauges and the core's cumulative counters (running, waiting, KV usage, preemptions, prefix-cache tokens) are read at
  scrape time from each engine's stats (`EngineClient.stats()`, a router's `replica_stats()`), the snapshot a core
  publishes after each step; so is the tokens-per-step histogram, as the cumulative bucket counts the core keeps;
- per-request figures (tokens, TTFT, inter-token latency, end-to-end latency, finish reasons) are recorded by
  `MeteredEngineClient`, an `EngineClient` that wraps another and watches the outputs pass. `jengine serve` hands the
  wrapped client to both front ends, so HTTP and gRPC traffic is counted alike. The phase times (queue, prefill,
  decode) come from the core's own timestamps on the outputs; a client whose outputs carry none (a remote engine over
  gRPC) records no phase samples rather than estimates. A request's engine is the one holding it at its first output
  (`Router.owner`).
`admission_rejections` is the server's own series (a request refused at admission has no engine), without the label.
No global registry: several servers can live in one process (tests do).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from jengine.clients.protocol import EngineClient, ModelInfo
from jengine.clients.router import Router
from jengine.engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats
from jengine.front.input_processor import PromptInput
from jengine.errors import CapacityError
from jengine.outputs import RequestOutput
from jengine.sampling.params import SamplingParams, StructuredOutputsParams
from jengine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PREFIX = "jengine:"
ENGINE_LABEL = "engine"  # on every engine-level series: "0".."N-1" (vLLM's label); a PromQL sum() adds them up
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # also the queue, prefill and decode phases (vLLM's request latency)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclasses.dataclass(frozen=True)
class EngineSources:
    """The engines behind a served client, as the metrics see them: engine "0".."N-1", in replica order."""

    count: int
    snapshots: Callable[[], list[EngineStats]]  # each engine's latest published stats
    serving: Callable[[str], int | None]  # the engine holding a request (asked at its first output)

    @classmethod
    def of(cls, client: EngineClient) -> EngineSources:
        """A router's replicas; any other client is one engine, engine "0"."""
        if isinstance(client, Router):
            return cls(len(client.replicas), client.replica_stats, client.owner)
        return cls(1, lambda: [client.stats()], lambda _request_id: 0)


_STATS_SERIES: tuple[tuple[type, str, str, Callable[[EngineStats], float]], ...] = (
    # (family, name, help, what it reads of a snapshot): gauges, then the core's cumulative counters
    (GaugeMetricFamily, "num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
    (GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", lambda s: s.kv_cache_usage),
    (CounterMetricFamily, "num_preemptions", "Cumulative number of preemptions.", lambda s: s.num_preemptions),
    (CounterMetricFamily, "prefix_cache_queries", "Prefix-cache queries, in tokens.", lambda s: s.prefix_cache_queries),
    (CounterMetricFamily, "prefix_cache_hits", "Prefix-cache hits, in tokens.", lambda s: s.prefix_cache_hits),
    (CounterMetricFamily, "spec_decode_num_drafts", "Speculative proposals verified.",
     lambda s: s.spec_decode_num_drafts),
    (CounterMetricFamily, "spec_decode_num_draft_tokens", "Speculative draft tokens verified.",
     lambda s: s.spec_decode_num_draft_tokens),
    (CounterMetricFamily, "spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.",
     lambda s: s.spec_decode_num_accepted_tokens),
)


class _EngineStatsCollector(Collector):
    """Turns each engine's stats snapshot into gauges and counters, one sample per engine, when Prometheus scrapes."""

    def __init__(self, sources: EngineSources, model_name: str) -> None:
        self._sources = sources
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        try:
            snapshots = self._sources.snapshots()
        except Exception:  # a remote engine that cannot answer now: serve the request-level metrics anyway
            logger.warning("engine stats unavailable for /metrics", exc_info=True)
            return
        for cls, name, doc, read in _STATS_SERIES:
            yield self._family(cls, name, doc, [read(s) for s in snapshots])
        yield self._cache_config(snapshots)
        yield from self._iteration_tokens(snapshots)
        yield from self._lora_info(snapshots)
        yield from self._accepted_per_position(snapshots)

    def _accepted_per_position(self, snapshots: list[EngineStats]) -> Iterator[Metric]:
        """Accepted draft tokens by their position in the proposal (vLLM's label `position`)."""
        if not any(s.spec_decode_num_accepted_tokens_per_pos for s in snapshots):
            return
        family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted draft tokens, by position in the proposal.",
                                     labels=["model_name", ENGINE_LABEL, "position"])
        for engine, stats in enumerate(snapshots):
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                family.add_metric([self._model, str(engine), str(position)], count)
        yield family

    def _cache_config(self, snapshots: list[EngineStats]) -> Metric:
        info = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the KV cache.",
                                 labels=["block_size", "num_gpu_blocks", "model_name", ENGINE_LABEL])
        for engine, stats in enumerate(snapshots):
            info.add_metric([str(stats.block_size), str(stats.num_gpu_blocks), self._model, str(engine)], 1.0)
        return info

    def _iteration_tokens(self, snapshots: list[EngineStats]) -> Iterator[Metric]:
        """Each core's per-step token histogram (nothing for an engine that does not report one)."""
        reported = [(engine, s) for engine, s in enumerate(snapshots) if s.step_token_counts]
        if not reported:
            return
        family = HistogramMetricFamily(PREFIX + "iteration_tokens_total", "Tokens computed per engine step.",
                                       labels=["model_name", ENGINE_LABEL])
        for engine, stats in reported:
            cumulative = list(itertools.accumulate(stats.step_token_counts))
            buckets = [(str(float(bound)), count) for bound, count in zip(ITERATION_TOKEN_BUCKETS, cumulative)]
            family.add_metric([self._model, str(engine)], buckets + [("+Inf", cumulative[-1])],
                              sum_value=stats.step_tokens_sum)
        yield family

    def _lora_info(self, snapshots: list[EngineStats]) -> Iterator[Metric]:
        """vLLM's `lora_requests_info`: the adapters of running and waiting requests as labels (comma-separated),
        valued with the time of the snapshot; only for engines serving adapters."""
        serving = [(engine, s) for engine, s in enumerate(snapshots) if s.max_loras]
        if not serving:
            return
        info = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters", ENGINE_LABEL])
        for engine, stats in serving:
            info.add_metric([",".join(stats.running_loras), str(stats.max_loras), ",".join(stats.waiting_loras),
                             str(engine)], time.time())
        yield info

    def _family(self, cls: type, name: str, doc: str, values: list[float]) -> Metric:
        family = cls(PREFIX + name, doc, labels=["model_name", ENGINE_LABEL])
        for engine, value in enumerate(values):
            family.add_metric([self._model, str(engine)], value)
        return family


@dataclasses.dataclass(frozen=True)
class EngineSeries:
    """One engine's request-level series: the registry's families bound to its `model_name` and `engine` labels."""

    model_name: str
    engine: str
    success: Any  # the family, still labelled by finish reason
    prompt_tokens: Any
    generation_tokens: Any
    ttft: Any
    itl: Any
    e2e: Any
    queue_time: Any
    prefill_time: Any
    decode_time: Any
    request_prompt_tokens: Any
    request_generation_tokens: Any

    def record_finish(self, finish_reason: str) -> None:
        self.success.labels(self.model_name, self.engine, finish_reason).inc()


_COUNTERS = (("prompt_tokens", "prompt_tokens", "Prefill tokens processed."),
             ("generation_tokens", "generation_tokens", "Generation tokens processed."))
_HISTOGRAMS = (  # (EngineSeries field, metric name, help, buckets)
    ("ttft", "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
    ("itl", "inter_token_latency_seconds", "Time between successive output tokens.", ITL_BUCKETS),
    ("e2e", "e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS),
    ("queue_time", "request_queue_time_seconds", "Time from arrival to first scheduling.", E2E_BUCKETS),
    ("prefill_time", "request_prefill_time_seconds", "Time from first scheduling to first token.", E2E_BUCKETS),
    ("decode_time", "request_decode_time_seconds", "Time from first token to last token.", E2E_BUCKETS),
    ("request_prompt_tokens", "request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS),
    ("request_generation_tokens", "request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS),
)


class EngineMetrics:
    """The registry of one server: per-engine series (request-level ones recorded by `MeteredEngineClient`, the
    rest read from the engines' stats) and the front's admission rejections."""

    def __init__(self, client: EngineClient, model_name: str, *, prefixes: tuple[str, ...] = ("jengine",),
                 log_requests: bool = False) -> None:
        """`prefixes`: the names /metrics shows each series under ("jengine", "vllm" or both, in that order);
        `log_requests`: one log line per finished request."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.prefixes = prefixes
        self.log_requests = log_requests
        self._sources = EngineSources.of(client)
        labels = ["model_name", ENGINE_LABEL]
        families: dict[str, Any] = {
            field: Counter(PREFIX + name, doc, labels, registry=self.registry) for field, name, doc in _COUNTERS}
        families.update({field: Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)
                         for field, name, doc, buckets in _HISTOGRAMS})
        success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                          labels + ["finished_reason"], registry=self.registry)
        self.engines = [
            EngineSeries(model_name, str(engine), success,
                         **{field: family.labels(model_name, str(engine)) for field, family in families.items()})
            for engine in range(self._sources.count)
        ]
        # The server's admission, before any engine holds the request (a router refuses once all replicas did).
        self._rejections = Counter(PREFIX + "admission_rejections", "Requests refused at admission, by reason.",
                                   ["model_name", "reason"], registry=self.registry)
        self._structured = Counter(PREFIX + "structured_output_requests",
                                   "Requests whose output is constrained (structured output), by kind.",
                                   ["model_name", "kind"], registry=self.registry)
        self.registry.register(_EngineStatsCollector(self._sources, model_name))

    def record_structured(self, kind: str) -> None:
        """One request constrained by a json schema, json_object, regex, choice, grammar or structural tag."""
        self._structured.labels(self.model_name, kind).inc()

    def series_for(self, request_id: str) -> EngineSeries:
        """The series of the engine serving `request_id` (engine 0 where the client cannot tell)."""
        engine = self._sources.serving(request_id)
        return self.engines[engine if engine is not None else 0]

    def record_rejection(self, reason: str) -> None:
        self._rejections.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of everything (counter samples carry `_total`), under each prefix."""
        return with_prefixes(generate_latest(self.registry), self.prefixes)

    def snapshots(self) -> list[EngineStats]:
        """Each engine's latest published stats, engine "0" first."""
        return self._sources.snapshots()

    def sample(self, name: str, engine: str) -> float:
        """One engine's current value of a request-level series (`prompt_tokens_total`, ...), 0 before any."""
        value = self.registry.get_sample_value(PREFIX + name, {"model_name": self.model_name, ENGINE_LABEL: engine})
        return value or 0.0


_NAME_AT_LINE_START = re.compile(rf"^(# (?:HELP|TYPE) )?{re.escape(PREFIX)}", re.MULTILINE)


def with_prefixes(exposition: bytes, prefixes: tuple[str, ...]) -> bytes:
    """The exposition once per prefix: `jengine:` names as they are, `vllm:` the same series renamed (vLLM's own
    names and meanings, so its dashboards read them unchanged)."""
    text = exposition.decode()
    return "".join(_NAME_AT_LINE_START.sub(lambda m: (m.group(1) or "") + prefix + ":", text)
                   for prefix in prefixes).encode()


class _RequestTracker:
    """Per-request bookkeeping between outputs: the engine serving it, which choices finished, when the previous
    token arrived."""

    def __init__(self, metrics: EngineMetrics, n: int) -> None:
        self._metrics = metrics
        self._n = n
        self._series: EngineSeries | None = None  # known at the first output, once an engine holds the request
        self._finished: set[int] = set()
        self._reasons: set[str] = set()  # the choices' finish reasons, for the request's log line
        self._num_generated = 0
        self._num_prompt = 0
        self._last_token_at: float | None = None
        # This process's clock, at the call (admission follows at once): a remote engine's times are not comparable.
        self._arrival = time.monotonic()

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        series = self._series
        if series is None:
            series = self._series = self._metrics.series_for(output.request_id)
            self._num_prompt = len(output.prompt_token_ids)
            series.prompt_tokens.inc(self._num_prompt)
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        if new_tokens:
            self._observe_tokens(series, new_tokens, now)
        for choice in output.outputs:
            if choice.finish_reason is not None and choice.index not in self._finished:
                self._finished.add(choice.index)
                self._reasons.add(choice.finish_reason)
                series.record_finish(choice.finish_reason)
        if output.finished:
            self._observe_end(series, output, now)

    def _observe_tokens(self, series: EngineSeries, new_tokens: int, now: float) -> None:
        series.generation_tokens.inc(new_tokens)
        if self._last_token_at is None:
            series.ttft.observe(max(0.0, now - self._arrival))
        else:
            series.itl.observe(now - self._last_token_at)
        self._last_token_at = now
        self._num_generated += new_tokens

    def _observe_end(self, series: EngineSeries, output: RequestOutput, now: float) -> None:
        series.e2e.observe(max(0.0, now - self._arrival))
        if self._metrics.log_requests:
            logger.info("finished request %s: %d prompt tokens, %d generated (%s) in %.3f s", output.request_id,
                        self._num_prompt, self._num_generated, ",".join(sorted(self._reasons)), now - self._arrival)
        series.request_prompt_tokens.observe(self._num_prompt)
        series.request_generation_tokens.observe(self._num_generated)
        times = output.metrics  # queue, prefill and decode on the engine's clock, where it reported both ends
        if times is None or times.first_scheduled_time is None:
            return  # never scheduled, or an engine that reports no scheduling times: no sample beats a guess
        for histogram, value in ((series.queue_time, times.queue_time), (series.prefill_time, times.prefill_time),
                                 (series.decode_time, times.decode_time)):
            if value is not None:
                histogram.observe(max(0.0, value))

    def close(self, reason: str = "abort") -> None:
        """The stream ended early (caller gone: "abort"; engine failure: "error"): unfinished choices count so."""
        if self._series is None:
            return  # never admitted (or failed before any output): not a request the engine served
        for _ in range(self._n - len(self._finished)):
            self._series.record_finish(reason)
        self._finished = set(range(self._n))


class MeteredEngineClient:
    """An `EngineClient` that records request-level metrics of everything streamed through it."""

    def __init__(self, inner: EngineClient, metrics: EngineMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    async def generate(self, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       **adapter: Any) -> AsyncIterator[RequestOutput]:
        """The inner stream, unchanged; closing this generator closes (and so aborts) the inner one. `adapter`:
        `lora_request=` for clients that serve adapters (`LoraClient`), passed on as given."""
        params = sampling_params or SamplingParams()
        tracker = _RequestTracker(self.metrics, params.n if isinstance(params.n, int) else 1)
        if isinstance(params.structured_outputs, StructuredOutputsParams):
            self.metrics.record_structured(params.structured_outputs.kind)
        reason = "abort"
        try:
            async with aclosing(self.inner.generate(prompt, params, request_id, priority=priority,
                                                    **adapter)) as stream:
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
