"""The last start's step programs loaded beside the weights (`runner/program_prefetch.py`): a start writes down the
programs it used; the next with its signature gets them from the threads, each only under its own key and devices,
and a stale, torn or failed list costs loads, never a wrong program or a start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import pytest

from jengine.runner.program_prefetch import ProgramPrefetch, read_start, start_signature


class CountingLoader:
    """A stand-in for the store's file load: 'program <key> on <ids>', or an error for the keys in `failing`."""

    def __init__(self, failing: tuple[str, ...] = ()) -> None:
        self.loaded: list[str] = []
        self.failing = failing
        self._lock = threading.Lock()

    def __call__(self, key: str, devices) -> str | None:
        with self._lock:
            self.loaded.append(key)
        if key in self.failing:
            raise RuntimeError("the load broke")
        if key.startswith("unreadable"):
            return None  # as the store's read gives for a torn file, after saying so
        return f"program {key} on {[d.id for d in devices]}"


def _start(tmp_path: Path, signature: str, keys: dict[str, list], loader=None, record: bool = True):
    """One start that uses `keys` (each on its devices) and ends; returns what its prefetch handed over (None:
    nothing, the store reads the file itself)."""
    prefetch = ProgramPrefetch(tmp_path, signature, loader or CountingLoader())
    taken = {key: prefetch.take(key, devices) for key, devices in keys.items()}
    handed = {key: program if prefetched else None for key, (prefetched, program) in taken.items()}
    prefetch.close(record=record)
    return handed


def test_the_next_start_gets_the_programs_the_last_one_used(tmp_path):
    one, two = jax.devices()[:1], jax.devices()[1:3]
    first = _start(tmp_path, "sig", {"a": one, "b": two})
    assert first == {"a": None, "b": None}  # nothing written down yet: the store reads the files itself
    loader = CountingLoader()
    again = _start(tmp_path, "sig", {"a": one, "b": two}, loader)
    assert again == {"a": f"program a on {[one[0].id]}", "b": f"program b on {[d.id for d in two]}"}
    assert sorted(loader.loaded) == ["a", "b"]


def test_another_signature_prefetches_nothing(tmp_path):
    _start(tmp_path, "sig", {"a": jax.devices()[:1]})
    loader = CountingLoader()
    assert _start(tmp_path, "other", {"a": jax.devices()[:1]}, loader) == {"a": None}
    assert loader.loaded == []


def test_a_program_is_handed_over_only_on_its_own_devices(tmp_path):
    _start(tmp_path, "sig", {"a": jax.devices()[:2]})
    swapped = [jax.devices()[1], jax.devices()[0]]  # the same devices, numbered otherwise by the program
    assert _start(tmp_path, "sig", {"a": swapped}) == {"a": None}


def test_a_changed_start_is_written_down_and_unused_programs_dropped(tmp_path, caplog):
    one = jax.devices()[:1]
    _start(tmp_path, "sig", {"a": one, "b": one})
    with caplog.at_level("INFO", logger="jengine.runner.program_prefetch"):
        handed = _start(tmp_path, "sig", {"b": one, "c": one})
    assert handed["b"] is not None and handed["c"] is None
    assert "1 prefetched step programs were not used" in caplog.text
    path = ProgramPrefetch(tmp_path, "sig", CountingLoader()).path
    assert list(read_start(path)) == ["b", "c"]


def test_a_failed_start_writes_nothing_down(tmp_path):
    one = jax.devices()[:1]
    _start(tmp_path, "sig", {"a": one})
    _start(tmp_path, "sig", {"z": one}, record=False)
    assert _start(tmp_path, "sig", {"a": one})["a"] is not None


def test_a_load_that_fails_is_left_to_the_store(tmp_path):
    one = jax.devices()[:1]
    _start(tmp_path, "sig", {"a": one, "b": one})
    handed = _start(tmp_path, "sig", {"a": one, "b": one}, CountingLoader(failing=("a",)))
    assert handed["a"] is None and handed["b"] is not None


def test_an_unreadable_program_is_not_read_twice(tmp_path):
    """The prefetch's read found the file torn (and said so): the store compiles without reading it again."""
    one = jax.devices()[:1]
    _start(tmp_path, "sig", {"unreadable": one})
    prefetch = ProgramPrefetch(tmp_path, "sig", CountingLoader())
    assert prefetch.take("unreadable", one) == (True, None)
    prefetch.close(record=False)


@pytest.mark.parametrize("text", ["{not json", json.dumps(["a"]), json.dumps({"a": ["0"]})])
def test_a_torn_list_prefetches_nothing(tmp_path, text):
    path = ProgramPrefetch(tmp_path, "sig", CountingLoader()).path
    path.parent.mkdir(parents=True)
    path.write_text(text)
    loader = CountingLoader()
    assert _start(tmp_path, "sig", {"a": jax.devices()[:1]}, loader) == {"a": None}
    assert loader.loaded == [] and list(read_start(path)) == ["a"]


def test_the_signature_follows_the_configuration_and_devices():
    from jengine.config import EngineConfig

    base = EngineConfig.from_kwargs("/models/a", max_model_len=1024)
    devices = jax.devices()[:2]
    assert start_signature(base, devices) == start_signature(EngineConfig.from_kwargs("/models/a",
                                                                                      max_model_len=1024), devices)
    assert start_signature(base, devices) != start_signature(EngineConfig.from_kwargs("/models/a",
                                                                                      max_model_len=2048), devices)
    assert start_signature(base, devices) != start_signature(base, devices[::-1])


REAL_PROGRAMS = """
import json, sys
from pathlib import Path
import jax, numpy as np
from tests.test_program_store import _args, affine
from jengine.runner.program_store import ProgramStore, device_assignment, program_key
args = _args(devices=jax.devices()[:2])
key, devices = program_key("affine", (), args), device_assignment(args)
store = ProgramStore(Path(sys.argv[1]))
if sys.argv[2] == "first":
    with store.prefetching("sig"):
        assert store.load(key, devices) is None
        store.save(key, affine.lower(*args).compile())
    print(json.dumps({}))
else:
    with store.prefetching("sig"):
        def unread(*_):
            raise AssertionError("read from the file, not the prefetch")
        store._read = unread
        loaded = store.load(key, devices)
    print(json.dumps({"same": bool((np.asarray(loaded(*args)) == np.asarray(affine(*args))).all())}))
"""


def test_a_real_program_comes_from_the_prefetch_in_the_next_process(tmp_path):
    """Two processes (without JAX's persistent cache, as the store's own round trip): the second start's program
    is the first's executable, taken from the prefetch threads, and computes what the jit does."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    outputs = []
    for role in ("first", "second"):
        out = subprocess.run([sys.executable, "-c", REAL_PROGRAMS, str(tmp_path), role], env=env, text=True,
                             capture_output=True, cwd=Path(__file__).resolve().parents[1], timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        outputs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert outputs[1] == {"same": True}
