"""Where a warm start's weight time goes: the host-side primitives of loading a checkpoint onto a GPU, each timed
at 1 to 16 threads over the same bytes of one file in the page cache.

  * `mmap_copy`: reading the mapped file into fresh host arrays (page faults on both sides), as a stacked or fused
    leaf's host copy does;
  * `preadv`: reading the file with `os.preadv` into fresh host arrays (no faults on the file's side);
  * `put_owned`: `jax.device_put` of host arrays that are already resident, to the device, done when ready;
  * `put_mapped`: `jax.device_put` straight from views of the mapping, as a single tensor's leaf does.

  PYTHONPATH=. python scripts/probe_weight_transfer_gpu.py --gib 4 --out $OUT/weight-transfer.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

CHUNK = 256 << 20  # bytes a task moves


def write_file(path: str, size: int) -> None:
    """`size` bytes of a non-constant pattern, written through the page cache (and left there)."""
    block = (np.arange(CHUNK // 8, dtype=np.uint64) * 0x9E3779B97F4A7C15).view(np.uint8)
    with open(path, "wb") as f:
        for _ in range(size // CHUNK):
            f.write(block)


def timed(tasks: list[Callable[[], object]], threads: int, finish: Callable[[list], None]) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(lambda task: task(), tasks))
    finish(results)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=4)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import jax

    device = jax.devices()[0]
    size = args.gib << 30
    path = os.path.join(tempfile.gettempdir(), "weight-transfer-probe.bin")
    write_file(path, size)
    fd = os.open(path, os.O_RDONLY)
    mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mapped, np.uint8)
    offsets = range(0, size, CHUNK)
    owned = [np.ones(CHUNK, np.uint8) for _ in offsets]  # resident host arrays for the device-only cases
    jax.block_until_ready(jax.device_put(owned[0][:1024], device))  # the client and its streams up

    def read_into(offset: int) -> np.ndarray:
        out = np.empty(CHUNK, np.uint8)
        os.preadv(fd, [memoryview(out)], offset)
        return out

    cases = {
        "mmap_copy": ([lambda o=o: np.array(view[o:o + CHUNK]) for o in offsets], lambda r: None),
        "preadv": ([lambda o=o: read_into(o) for o in offsets], lambda r: None),
        "put_owned": ([lambda c=c: jax.device_put(c, device) for c in owned], jax.block_until_ready),
        "put_mapped": ([lambda o=o: jax.device_put(view[o:o + CHUNK], device) for o in offsets],
                       jax.block_until_ready),
    }
    results: dict[str, dict[str, float]] = {}
    for name, (tasks, finish) in cases.items():
        results[name] = {}
        for threads in args.threads:
            try:
                seconds = timed(tasks, threads, finish)
                results[name][f"t{threads}_gb_per_s"] = size / seconds / 1e9
                print(f"{name:10s} {threads:2d} threads: {size / seconds / 1e9:6.2f} GB/s", flush=True)
            except Exception as error:  # noqa: BLE001 - a probe reports what failed and goes on
                results[name][f"t{threads}_error"] = repr(error)[:300]
                print(f"{name:10s} {threads:2d} threads: {error!r}"[:300], flush=True)
    os.unlink(path)
    with open(args.out, "w") as f:
        json.dump({"device": device.device_kind, "gib": args.gib, "chunk_bytes": CHUNK, "cpus": os.cpu_count(),
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
