"""What the GPU benchmark scripts share: JAX timing, the two measured ceilings (device-to-device copy bandwidth and the
bf16 matrix rate), package versions, and the results file (DESIGN.md's format: one file per benchmark, several calls
merged into it).

Imports jax only inside the functions that time device work, so a script's orchestrating process (and the CPU tests)
can use the file helpers without a device.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

RESULT_KEYS = ("benchmark", "git_sha", "date", "device", "versions", "command", "metrics", "ratios")


def log(*args: Any) -> None:
    print(*args, flush=True)


def median(values: list[float]) -> float:
    """The upper median (the middle value, no averaging); NaN for none."""
    return sorted(values)[len(values) // 2] if values else float("nan")


def timeit(fn: Callable, *args: Any, runs: int = 5, target_s: float = 0.05, min_calls: int = 5,
           max_calls: int = 400) -> float:
    """Median seconds per call over `runs` runs of back-to-back calls, one `block_until_ready` per run."""
    import jax

    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    n = int(min(max(target_s / max(time.perf_counter() - t0, 1e-6), min_calls), max_calls))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def replay_seconds(call: Callable[[], Any], *, warmup: int, runs: int, calls: int) -> float:
    """Median seconds per call of a stateful `call` (it feeds its own donated state along and returns what to wait
    on): `warmup` calls, then `runs` runs of `calls` back-to-back calls with one synchronisation per run."""
    import jax

    for _ in range(warmup):
        out = call()
    jax.block_until_ready(out)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            out = call()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def copy_bandwidth(num_elements: int = 1 << 30, runs: int = 5, min_calls: int = 5) -> tuple[float, float]:
    """(seconds per copy, bytes/s) of a bf16 device-to-device copy, bytes read + written (2 GiB copied by default)."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(1), (num_elements,), jnp.bfloat16)
    t = timeit(jax.jit(lambda a: a.copy()), x, runs=runs, min_calls=min_calls)
    rate = 2 * x.nbytes / t
    del x
    return t, rate


def matmul_rate(n: int = 8192, runs: int = 5, min_calls: int = 5) -> float:
    """FLOP/s of an n×n×n bf16 matrix product on random data (zeros run faster and would flatter the ceiling)."""
    import jax
    import jax.numpy as jnp

    a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in jax.random.split(jax.random.key(2)))
    t = timeit(jax.jit(lambda x, y: x @ y), a, b, runs=runs, min_calls=min_calls)
    return 2 * n ** 3 / t


def versions(extra: Iterable[str] = ()) -> dict[str, str]:
    """Python and the installed versions of jax, jaxlib, the CUDA plugin, Triton and any `extra` distributions."""
    out = {"python": platform.python_version()}
    for dist in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "triton", *extra):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def device_memory_bytes() -> int:
    """Memory of the first GPU as nvidia-smi reports it, without creating a CUDA context in this process."""
    import subprocess

    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) << 20


def jax_device_name() -> str:
    import jax

    device = jax.devices()[0]
    return f"{device.device_kind} ({device.platform})"


def result_record(benchmark: str, git_sha: str, device: str, versions_: dict, command: str, metrics: dict,
                  ratios: dict, **extra: Any) -> dict[str, Any]:
    """A results file's content; `extra` keys (method notes, say) follow the required ones."""
    record = {"benchmark": benchmark, "git_sha": git_sha, "date": datetime.date.today().isoformat(), "device": device,
              "versions": versions_, "command": command, "metrics": metrics, "ratios": ratios}
    return record | extra


def merge_records(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new`'s figures merged into `base` (a benchmark split over several calls ends in one file). Dict-valued keys
    are merged key by key (`new` wins), lists joined, the commands of both calls kept and the earlier date; a
    different benchmark, git sha or device is refused: such figures are not one run's."""
    for key in ("benchmark", "git_sha", "device"):
        if _known(base.get(key)) and _known(new.get(key)) and base[key] != new[key]:
            raise ValueError(f"cannot merge results with different {key}: {base[key]!r} vs {new[key]!r}")
    merged = dict(base)
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        elif isinstance(value, list) and isinstance(merged.get(key), list):
            merged[key] = merged[key] + [item for item in value if item not in merged[key]]
        elif key == "command" and _known(merged.get(key)) and _known(value):
            if value not in merged[key].split(" ; "):
                merged[key] = f"{merged[key]} ; {value}"
        elif key == "date" and _known(merged.get(key)) and _known(value):
            merged[key] = min(merged[key], value)
        elif _known(value) or key not in merged:
            merged[key] = value
    return merged


def _known(value: Any) -> bool:
    return value not in (None, "", "unknown")


def read_record(path: str | Path) -> dict[str, Any]:
    record = json.loads(Path(path).read_text())
    missing = [key for key in RESULT_KEYS if key not in record]
    if missing:
        raise ValueError(f"{path} is not a results file: it lacks {', '.join(missing)}")
    return record


def write_record(path: str | Path, record: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def print_tables(record: dict[str, Any]) -> None:
    """The short table each run ends with (ratios first: they are what the targets name)."""
    for title, values in (("ratio", record.get("ratios", {})), ("metric", record.get("metrics", {}))):
        log(f"\n| {title} | value |\n| --- | --- |")
        for key, value in values.items():
            log(f"| {key} | {value:.4g} |" if isinstance(value, (int, float)) else f"| {key} | {value} |")
