"""Per-request timings → the figures `vllm bench` reports: throughput, TTFT / TPOT / ITL / e2e latency (mean and
percentiles, in ms) and goodput (requests per second that met every SLO of --goodput)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclasses.dataclass
class RequestResult:
    """One request, times in seconds: TTFT, the gaps between streamed token chunks, and end-to-end latency."""

    prompt_len: int
    output_len: int
    e2el: float
    ttft: float | None = None
    itls: list[float] = dataclasses.field(default_factory=list)
    success: bool = True
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - TTFT) / (output_len - 1); None with fewer than 2 tokens."""
        if self.ttft is None or self.output_len < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)


def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] → {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of {', '.join(SLO_NAMES)}, got {item!r}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slo[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be positive")
    return slo


def meets_slo(result: RequestResult, slo: dict[str, float]) -> bool:
    values = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.e2el}
    for name, limit_ms in slo.items():
        value = values[name]
        if name == "tpot" and value is None:  # a single token has no TPOT: nothing to violate
            continue
        if value is None or value * 1000.0 > limit_ms:
            return False
    return True


def _summary(prefix: str, values_s: Sequence[float], percentiles: Sequence[int]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {f"mean_{prefix}_ms": float(ms.mean()) if ms.size else 0.0}
    for p in percentiles:
        out[f"p{p}_{prefix}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    return out


def compute_metrics(results: Sequence[RequestResult], duration: float, *, slo: dict[str, float] | None = None,
                    percentiles: Sequence[int] = PERCENTILES, streamed: bool = True) -> dict[str, float | int]:
    """Percentiles interpolate linearly between the sorted samples (numpy's default). `streamed=False` (offline
    runs, whose outputs arrive whole) leaves out the ITL, which only streaming measures, rather than report 0."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    metrics: dict[str, float | int] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
    }
    metrics.update(_summary("ttft", [r.ttft for r in done if r.ttft is not None], percentiles))
    metrics.update(_summary("tpot", [t for r in done if (t := r.tpot) is not None], percentiles))
    if streamed:
        metrics.update(_summary("itl", [gap for r in done for gap in r.itls], percentiles))
    metrics.update(_summary("e2el", [r.e2el for r in done], percentiles))
    if slo:
        good = sum(meets_slo(r, slo) for r in done)
        metrics["good_requests"] = good
        metrics["request_goodput"] = good / duration if duration > 0 else 0.0
    return metrics


def format_table(title: str, metrics: dict, percentiles: Sequence[int] = PERCENTILES) -> str:
    """The short table printed at the end of a run."""
    rows: list[tuple[str, str]] = []
    labels = {
        "duration": "Benchmark duration (s)", "completed": "Successful requests", "failed": "Failed requests",
        "total_input_tokens": "Total input tokens", "total_output_tokens": "Total generated tokens",
        "request_throughput": "Request throughput (req/s)", "request_goodput": "Request goodput (req/s)",
        "output_throughput": "Output token throughput (tok/s)",
        "total_token_throughput": "Total token throughput (tok/s)",
        "spec_decode_acceptance_rate": "Draft acceptance rate", "spec_decode_acceptance_length": "Acceptance length",
    }
    for key, label in labels.items():
        if key in metrics:
            value = metrics[key]
            rows.append((label, f"{value:.2f}" if isinstance(value, float) else str(value)))
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"),
                        ("latency", "Latency per iteration")):
        if f"mean_{name}_ms" not in metrics:
            continue
        rows.append((f"-- {label} (ms) --", ""))
        rows.append(("Mean", f"{metrics[f'mean_{name}_ms']:.2f}"))
        for p in percentiles:
            rows.append((f"P{p}", f"{metrics[f'p{p}_{name}_ms']:.2f}"))
    width = max(len(label) for label, _ in rows) + 2
    bar = "=" * (width + 14)
    lines = [f"{f' {title} ':=^{width + 14}}"]
    lines += [f"{label:<{width}}{value:>14}" if value else f"{label:-^{width + 14}}" for label, value in rows]
    lines.append(bar)
    return "\n".join(lines)
