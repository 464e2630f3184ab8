"""Soak: mixed traffic against a `jengine serve` for `--duration` seconds, watching for leaks.

    PYTHONPATH=. python scripts/soak.py --duration 1800 --output benchmarks/results/<date>-soak.json

With no `--url` it starts `python -m jengine serve` (the demo model, loopback, a small admission bound of 4 running +
4 queued so bursts of `--burst` requests meet 429s) and stops it with SIGTERM at the end; with `--url` and `--pid` it
drives a server already running on this machine (`--burst` must then exceed its max_num_seqs + max_num_queued_reqs).

Traffic (scripts/soak_traffic.py): `--concurrency` workers each send one request after another (completions and chat,
streamed or not, n up to 3, streams the client closes mid-way, requests it stops waiting for, bad inputs that must get
a 4xx), plus a burst of `--burst` requests at once every `--burst-interval` seconds. Every request lands in a ledger:
sent = ok + refused + cancelled + errored; `lost_requests` = sent minus the rest (no answer within the timeout).

Sampled every `--sample-interval` s: the server's RSS (/proc/<pid>/status VmRSS), its open file descriptors
(/proc/<pid>/fd) and /metrics' `jengine:kv_cache_usage_perc`, `num_requests_running` and `num_requests_waiting`.
- `rss_growth_mb`: the samples after the warm-up (the first `--warmup` s, default a tenth of the run, at most 120 s:
  caches, allocator arenas and compiled programs settle) are split in quarters; the median of the last quarter minus
  the median of the first. A leak grows steadily; noise and one-off allocations do not move a median.
- `fd_growth`: descriptors open with no client connected and the engine idle, at the end minus after the warm-up
  (both counted with every client closed, so keep-alive sockets do not count).
- At the end the engine must be idle: KV usage 0, no request running or waiting.
The process exits 1 when a target fails (rss_growth_mb ≤ 50, fd_growth = 0, lost_requests = 0, errored = 0).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak_traffic as traffic  # noqa: E402
from gpu_bench_common import versions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"rss_growth_mb": 50.0, "fd_growth": 0, "lost_requests": 0}


@dataclasses.dataclass(frozen=True)
class SoakSettings:
    duration: float = 1800.0
    warmup: float | None = None  # None: a tenth of the duration, at most 120 s
    concurrency: int = 4
    burst: int = 24
    burst_interval: float = 20.0
    sample_interval: float = 5.0
    request_timeout: float = 120.0
    seed: int = 0

    @property
    def warmup_s(self) -> float:
        return self.warmup if self.warmup is not None else min(120.0, self.duration / 10)


@dataclasses.dataclass(frozen=True)
class Sample:
    t: float
    rss_mb: float
    fds: int
    kv_usage: float
    running: float
    waiting: float


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def engine_gauges(client: httpx.AsyncClient) -> dict[str, float]:
    """kv_cache_usage_perc, num_requests_running, num_requests_waiting from /metrics (summed over label sets)."""
    text = (await client.get("/metrics")).text
    wanted = {"jengine:kv_cache_usage_perc": "kv", "jengine:num_requests_running": "running",
              "jengine:num_requests_waiting": "waiting"}
    values = dict.fromkeys(wanted.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            values[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return values


async def sampler(url: str, pid: int, interval: float, samples: list[Sample], stop: asyncio.Event,
                  quiet: asyncio.Lock) -> None:
    """Appends a Sample every `interval` seconds until `stop` is set. Each sample uses its own connection, closed
    before `quiet` is released, so an idle descriptor count (taken under `quiet`) never includes the sampler's."""
    start = time.monotonic()
    while not stop.is_set():
        async with quiet, httpx.AsyncClient(base_url=url, timeout=30) as client:
            gauges = await engine_gauges(client)
            samples.append(Sample(round(time.monotonic() - start, 2), round(rss_mb(pid), 2), open_fds(pid),
                                  gauges["kv"], gauges["running"], gauges["waiting"]))
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass


async def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    """Polls /metrics until no request runs or waits and KV usage is 0 (or the timeout); the last gauges."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while True:
            gauges = await engine_gauges(client)
            if not any(gauges.values()) or time.monotonic() > deadline:
                return gauges
            await asyncio.sleep(0.2)


async def idle_fds(pid: int) -> int:
    """Descriptors once every client is closed: the count that two readings 0.5 s apart agree on."""
    previous = open_fds(pid)
    for _ in range(20):
        await asyncio.sleep(0.5)
        current = open_fds(pid)
        if current == previous:
            return current
        previous = current
    return previous


async def traffic_phase(url: str, target: traffic.Target, ledger: traffic.Ledger, settings: SoakSettings,
                        seconds: float, seed: int) -> None:
    """Workers and bursts for `seconds`, on one client that is closed afterwards (its sockets with it)."""
    limits = httpx.Limits(max_connections=settings.burst + settings.concurrency + 4, max_keepalive_connections=8)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        until = asyncio.get_running_loop().time() + seconds
        workers = [traffic.worker(client, random.Random(seed * 1000 + i), target, ledger, until,
                                  settings.request_timeout) for i in range(settings.concurrency)]
        burst = traffic.bursts(client, random.Random(seed * 1000 + 999), target, ledger, until,
                               settings.request_timeout, settings.burst, settings.burst_interval)
        await asyncio.gather(*workers, burst)


async def run_soak(url: str, pid: int, settings: SoakSettings, target: traffic.Target | None = None
                   ) -> dict[str, Any]:
    """Warm-up, idle baseline, the main traffic, idle end state; the metrics dict of the results file."""
    if target is None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            target = traffic.Target((await client.get("/v1/models")).json()["data"][0]["id"])
    ledger, samples, stop, quiet = traffic.Ledger(), [], asyncio.Event(), asyncio.Lock()
    sampling = asyncio.ensure_future(sampler(url, pid, settings.sample_interval, samples, stop, quiet))
    started = time.monotonic()
    await traffic_phase(url, target, ledger, settings, settings.warmup_s, settings.seed)
    await wait_idle(url)
    async with quiet:
        fds_start, warm_at = await idle_fds(pid), time.monotonic() - started
    # the main traffic's seconds are the run's less the warm-up's traffic, not less the wait for the warm-up's
    # requests to end: a server compiling its first shapes would otherwise leave no main traffic at all
    await traffic_phase(url, target, ledger, settings, max(0.0, settings.duration - settings.warmup_s),
                        settings.seed + 1)
    end_gauges = await wait_idle(url)
    stop.set()
    await sampling
    async with quiet:
        fds_end = await idle_fds(pid)
    return summarize(ledger, samples, warm_at, fds_start, fds_end, end_gauges, time.monotonic() - started)


def rss_growth(samples: list[Sample], warm_at: float) -> tuple[float, float, float]:
    """(growth, first-quarter median, last-quarter median) of the RSS samples after the warm-up, in MB."""
    rss = [s.rss_mb for s in samples if s.t >= warm_at] or [s.rss_mb for s in samples]
    quarter = max(1, len(rss) // 4)
    first, last = statistics.median(rss[:quarter]), statistics.median(rss[-quarter:])
    return round(last - first, 2), first, last


def summarize(ledger: traffic.Ledger, samples: list[Sample], warm_at: float, fds_start: int, fds_end: int,
              end_gauges: dict[str, float], elapsed: float) -> dict[str, Any]:
    growth, first, last = rss_growth(samples, warm_at)
    counts = ledger.summary()
    step = max(1, len(samples) // 60)  # a timeline of about 60 points
    return {
        "duration_s": round(elapsed, 1), "warmup_s": round(warm_at, 1), "rss_growth_mb": growth,
        "rss_first_quarter_median_mb": first, "rss_last_quarter_median_mb": last,
        "rss_max_mb": max(s.rss_mb for s in samples), "fd_growth": fds_end - fds_start, "fds_idle_start": fds_start,
        "fds_idle_end": fds_end, "fds_max": max(s.fds for s in samples), "lost_requests": ledger.lost,
        "ledger_balances": ledger.lost == 0, "requests_per_s": round(ledger.sent / elapsed, 2),
        "kv_usage_max": max(s.kv_usage for s in samples), "kv_usage_end": end_gauges["kv"],
        "running_end": end_gauges["running"], "waiting_end": end_gauges["waiting"], "counts": counts,
        "samples": len(samples),
        "timeline": {"fields": ["t_s", "rss_mb", "fds", "kv_usage", "running", "waiting"],
                     "rows": [list(dataclasses.astuple(s)) for s in samples[::step]]},
    }


def failures(metrics: dict[str, Any]) -> list[str]:
    found = [f"rss_growth_mb {metrics['rss_growth_mb']} > {TARGETS['rss_growth_mb']}"
             ] if metrics["rss_growth_mb"] > TARGETS["rss_growth_mb"] else []
    found += [f"{name} {metrics[name]} != 0" for name in ("fd_growth", "lost_requests") if metrics[name] != 0]
    found += [f"{n} at the end: {metrics[k]}" for n, k in (("KV usage", "kv_usage_end"), ("running", "running_end"),
                                                            ("waiting", "waiting_end")) if metrics[k]]
    return found + ([f"{metrics['counts']['errored']} errored"] if metrics["counts"]["errored"] else [])


# ------------------------------------------------------------------------------------------------ server and report
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_server(log_path: Path, extra: list[str]) -> tuple[subprocess.Popen, str, list[str]]:
    """`python -m jengine serve` (demo model) on a free loopback port, healthy; (process, url, its argv)."""
    port = free_port()
    argv = [sys.executable, "-m", "jengine", "serve", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
            "--max-num-seqs", "4", "--max-num-queued-reqs", "4", "--max-model-len", "512", "--compile-buckets", "all",
            *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with log_path.open("w") as log:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 600
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"jengine serve exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url, argv
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"jengine serve was not healthy within 600 s; see {log_path}")
        time.sleep(0.5)


def stop_server(process: subprocess.Popen) -> int:
    """SIGTERM (a drain), then the exit status."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def device_description() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    return f"CPU only: {model}, {os.cpu_count()} cores, {mem_kb / 2**20:.0f} GiB RAM (shared with other work)"


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic, warm-up included")
    parser.add_argument("--warmup", type=float, default=None, help="seconds (default: duration/10, at most 120)")
    parser.add_argument("--output", type=Path,
                        default=ROOT / f"benchmarks/results/{datetime.date.today().isoformat()}-soak.json")
    parser.add_argument("--url", help="a running server (default: start the demo server)")
    parser.add_argument("--pid", type=int, help="the running server's process id (with --url)")
    parser.add_argument("--server-log", type=Path, default=Path("soak-server.log"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--burst", type=int, default=24)
    parser.add_argument("--burst-interval", type=float, default=20.0)
    parser.add_argument("--sample-interval", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("serve_args", nargs="*", help="after --: more `jengine serve` flags for the started server")
    args = parser.parse_args(argv)
    if (args.url is None) != (args.pid is None):
        parser.error("--url and --pid go together")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = SoakSettings(args.duration, args.warmup, args.concurrency, args.burst, args.burst_interval,
                            args.sample_interval, seed=args.seed)
    sha, date = git_sha(), datetime.date.today().isoformat()  # of the code that runs (the tree may move meanwhile)
    process, url, pid, serve_argv = None, args.url, args.pid, None
    if url is None:
        process, url, serve_argv = launch_server(args.server_log, args.serve_args)
        pid = process.pid
    try:
        metrics = asyncio.run(run_soak(url, pid, settings))
    finally:
        if process is not None:
            exit_code = stop_server(process)
    if process is not None:
        metrics["server_exit_code"] = exit_code
        metrics["server_command"] = " ".join(serve_argv[1:])
    result = {"benchmark": "soak", "git_sha": sha, "date": date,
              "device": device_description(), "versions": versions(("aiohttp", "httpx", "grpcio")),
              "command": "PYTHONPATH=. python scripts/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "metrics": metrics, "ratios": {}}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    problems = failures(metrics)
    counts = metrics["counts"]
    print(f"soak {metrics['duration_s']} s: sent {counts['sent']} = ok {counts['ok']} + refused {counts['refused']} + "
          f"cancelled {counts['cancelled']} + errored {counts['errored']} + lost {counts['lost']}; rss growth "
          f"{metrics['rss_growth_mb']} MB, fd growth {metrics['fd_growth']}, KV at the end {metrics['kv_usage_end']}")
    print("FAIL: " + "; ".join(problems) if problems else "all targets met", f"-> {args.output}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
