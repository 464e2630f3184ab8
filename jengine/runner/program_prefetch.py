"""The saved step programs of the last start, loaded on threads while the weights load.

A warm start spent its seconds one after the other: the weights to the device (about 5 s for an 8B model), then
every step program loaded from the `ProgramStore` (about 2.5 s on 8 threads), whose keys need the placed weights'
shardings and the KV pool's shape. Each start's keys are also written down here, under the start's signature (the
engine configuration and devices); the next start with that signature begins loading those executables at once,
beside the weights. The runner still computes every key from its real arguments and takes a prefetched program only
under its own key, on the devices it asks for: a stale list costs loads that go unused, never a wrong program.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger(__name__)

STARTS_DIRNAME = "starts"  # one list of keys per start signature, inside the installation's folder
PREFETCH_THREADS = 8  # as many as start-up's compile threads: each load is mostly XLA's, off the GIL

Loader = Callable[[str, Sequence[jax.Device]], Any]  # (key, devices) -> the executable or None


class ProgramPrefetch:
    """Loads the programs the last start with `signature` used, on threads, from the moment it is built.
    `take` hands one over (waiting for its load) and counts its key as this start's; `close` can write those down."""

    def __init__(self, folder: Path, signature: str, load: Loader, threads: int = PREFETCH_THREADS) -> None:
        self.path = folder / STARTS_DIRNAME / hashlib.sha256(signature.encode()).hexdigest()[:32]
        self._lock = threading.Lock()
        self._used: dict[str, list[int]] = {}  # this start's keys, in order, with their devices' ids in order
        self._listed = listed = read_start(self.path)
        by_id = {device.id: device for device in jax.devices()}
        self._pending: dict[str, tuple[tuple[int, ...], Future]] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="program-prefetch") if listed else None
        for key, ids in listed.items():
            if all(i in by_id for i in ids):
                devices = [by_id[i] for i in ids]
                self._pending[key] = (tuple(ids), self._pool.submit(load, key, devices))
        if self._pending:
            logger.info("loading the %d step programs of the last start beside the weights", len(self._pending))

    def take(self, key: str, devices: Sequence[jax.Device]) -> tuple[bool, Any]:
        """(True, what the load of `key` for `devices` (in the order the program numbers them) gave: the executable,
        or None for a file that could not be read) once loaded, where it was prefetched; (False, None) where it was
        not, or its load raised: the store then reads the file itself."""
        with self._lock:
            self._used[key] = [device.id for device in devices]
            entry = self._pending.pop(key, None)
        if entry is None or entry[0] != tuple(device.id for device in devices):
            return False, None
        try:
            return True, entry[1].result()
        except Exception:  # the store's own read reports what goes wrong
            return False, None

    def close(self, record: bool) -> None:
        """Ends the prefetch (loads not yet started are dropped, programs never taken released) and, with
        `record`, writes down this start's keys for the next one where they differ from what was read."""
        with self._lock:
            unused, self._pending = len(self._pending), {}
            used = dict(self._used)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if unused:
            logger.info("%d prefetched step programs were not used by this start", unused)
        if record and used and used != self._listed:
            write_start(self.path, used)


def start_signature(config: Any, devices: Sequence[jax.Device]) -> str:
    """What decides a start's step programs before its weights are read: the engine configuration (model path,
    dtype, shapes, backend options) and the devices, in order."""
    return repr((config, [(device.platform, device.id) for device in devices]))


def read_start(path: Path) -> dict[str, list[int]]:
    """The keys a start wrote down, each with its devices' ids; empty where there is none or it cannot be read."""
    try:
        listed = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(listed, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(i, int) for i in v)
            for k, v in listed.items()):
        return {}
    return listed


def write_start(path: Path, used: dict[str, list[int]]) -> None:
    """Writes the list whole, then renames it (a reader never sees a part); a failure costs the next start its
    prefetch only."""
    part = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as part:
            json.dump(used, part)
        os.replace(part.name, path)
    except OSError as error:
        logger.warning("could not write down this start's step programs (%s)", error)
        if part is not None:
            Path(part.name).unlink(missing_ok=True)
