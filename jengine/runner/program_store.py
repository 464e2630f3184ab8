"""Compiled step programs saved whole, so that a restart neither traces nor lowers them.

JAX's persistent compilation cache skips XLA's compile on a restart, but its key is the lowered program: every step
program is still traced and lowered first, on the host, under the GIL (on an H100, 56 step variants of an 8B model
took 5.7 s of a 13.3 s warm start, most of it that Python). Here each compiled program is also saved as an
executable (`jax.experimental.serialize_executable`) under a key computed without tracing: this installation's
identity (the jengine and pallas_kernels sources, the jax and jaxlib versions, the devices, XLA_FLAGS and jax's
configuration) and the call's static model and argument shapes, dtypes and shardings. A restart with the same key
loads the executable; anything that changed the program changes the key. A file that cannot be read is compiled
again (and replaced). Code patched at run time is not in the key: a benchmark that patches the model for an A/B
sets `JENGINE_PROGRAM_STORE=off` (STORE_SWITCH) while it does. Only the few most recently used installations'
folders are kept (`prune_installations`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax

from jengine.runner.program_prefetch import ProgramPrefetch

logger = logging.getLogger(__name__)

STORE_DIRNAME = "jengine-programs"  # beside the compilation cache's own files
STORE_SWITCH = "JENGINE_PROGRAM_STORE"  # "off": no program is loaded or saved
KEPT_INSTALLATIONS = 3  # folders kept: this installation's and the most recently used others (several venvs)


class ProgramStore:
    """Executables in `directory`, keyed by `program_key`, one folder per installation: each upgrade or source
    change starts a new one, and the first save of a process removes all but the KEPT_INSTALLATIONS most recently
    used (a load or save marks its folder used), so the store does not grow with every version."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory / installation_identity()[:24]
        self._pruned = False
        self.prefetch: ProgramPrefetch | None = None  # the last start's programs, loading (`prefetching`)

    @classmethod
    def beside(cls, compilation_cache_dir: str | None, platform: str) -> ProgramStore | None:
        """The store beside the compilation cache; None where that is off (programs are then compiled each start),
        where STORE_SWITCH says "off", or on the CPU, whose executables come back incomplete (jaxlib 0.11.2: a
        loaded step program can miss a function its compile emitted apart, "Function wrapped_iota not found"; the
        CPU compiles lazily anyway)."""
        if not compilation_cache_dir or platform == "cpu" or os.environ.get(STORE_SWITCH) == "off":
            return None
        return cls(Path(compilation_cache_dir) / STORE_DIRNAME)

    @contextlib.contextmanager
    def prefetching(self, signature: str) -> Iterator[ProgramStore]:
        """Within: the programs the last start with `signature` used load on threads (`ProgramPrefetch`), and
        `load` takes them from there. On leaving without an error, this start's programs are written down for the
        next."""
        prefetch = self.prefetch = ProgramPrefetch(self.directory, signature, self._read)
        completed = False
        try:
            yield self
            completed = True
        finally:
            self.prefetch = None
            prefetch.close(record=completed)

    def load(self, key: str, devices: Sequence[jax.Device]) -> Any | None:
        """The executable saved under `key`, loaded onto `devices` (its arguments' device assignment, in order);
        None where none is saved (or it cannot be read)."""
        if self.prefetch is not None:
            prefetched, program = self.prefetch.take(key, devices)
            if prefetched:  # None here: the file could not be read, and the prefetch's read said so
                return program
        return self._read(key, devices)

    def _read(self, key: str, devices: Sequence[jax.Device]) -> Any | None:
        from jax.experimental import serialize_executable

        path = self.directory / key
        if not path.exists():
            return None
        _mark_used(self.directory)
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                             backend=devices[0].client, execution_devices=devices)
        except Exception as error:  # a torn or foreign file: compiled again, and replaced
            logger.warning("could not load the saved step program %s (%s: %s); compiling it", path,
                           type(error).__name__, error)
            return None

    def save(self, key: str, compiled: Any) -> None:
        """Saves `compiled` under `key` (written whole, then renamed: readers never see a part)."""
        from jax.experimental import serialize_executable

        part = None
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False) as part:
                part.write(blob)
            os.replace(part.name, self.directory / key)
            _mark_used(self.directory)
        except Exception as error:  # a full disk or an unserialisable program costs the next start a compile
            logger.warning("could not save a step program (%s: %s)", type(error).__name__, error)
            if part is not None:  # a part written short stays out of the store
                Path(part.name).unlink(missing_ok=True)
        if not self._pruned:
            self._pruned = True
            try:
                prune_installations(self.directory.parent, keep=self.directory)
            except OSError as error:  # tidying up never stops a start
                logger.warning("could not remove older saved step programs (%s)", error)


def prune_installations(root: Path, keep: Path, count: int = KEPT_INSTALLATIONS) -> list[Path]:
    """Removes the installation folders under `root` beyond the `count` most recently used (`keep` always stays);
    returns what it removed. A folder another process removes first, or that cannot be removed, is passed over."""
    import shutil

    if not root.is_dir():
        return []
    others = sorted((f for f in root.iterdir() if f.is_dir() and f != keep), key=_last_used, reverse=True)
    removed = []
    for folder in others[max(count - 1, 0):]:
        size = _folder_bytes(folder)
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            removed.append(folder)
            logger.info("removed the saved step programs of an older installation (%s, %.1f MB)", folder.name,
                        size / 1e6)
    return removed


def _last_used(folder: Path) -> float:
    try:
        return folder.stat().st_mtime
    except OSError:
        return 0.0


def _folder_bytes(folder: Path) -> int:
    total = 0
    for path in folder.glob("*"):
        try:
            total += path.stat().st_size
        except OSError:
            pass
    return total


def _mark_used(folder: Path) -> None:
    try:
        os.utime(folder)
    except OSError:  # removed meanwhile by another process's pruning: the next save makes it again
        pass


def program_key(name: str, static: Hashable, args: tuple) -> str:
    """The key of program `name` for `static` (its static arguments) and `args` (arrays or ShapeDtypeStructs):
    their tree, shapes, dtypes, shardings and the shardings' devices."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    signature = [(tuple(leaf.shape), str(leaf.dtype), str(getattr(leaf, "sharding", None)),
                  _device_ids(getattr(leaf, "sharding", None))) for leaf in leaves]
    text = repr((name, repr(static), str(treedef), signature))
    return hashlib.sha256(text.encode()).hexdigest()


def device_assignment(args: tuple) -> Sequence[jax.Device]:
    """The devices a program of `args` runs on, in the order its executable numbers them (all its arguments
    share one assignment: the engine's mesh, or one device)."""
    return next(leaf.sharding for leaf in jax.tree_util.tree_leaves(args)
                if getattr(leaf, "sharding", None) is not None)._device_assignment


def _device_ids(sharding: jax.sharding.Sharding | None) -> tuple[int, ...]:
    return () if sharding is None else tuple(sorted(device.id for device in sharding.device_set))


@functools.cache
def installation_identity() -> str:
    """What every saved program depends on besides its own call: the sources, versions, devices and flags."""
    import jaxlib

    import jengine
    import pallas_kernels

    digest = hashlib.sha256()
    for package in (jengine, pallas_kernels):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    config = sorted((name, repr(value)) for name, value in jax.config.values.items())
    digest.update(repr((jax.__version__, jaxlib.__version__, devices, os.environ.get("XLA_FLAGS", ""),
                        config)).encode())
    return digest.hexdigest()
