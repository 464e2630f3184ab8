"""Saved step programs (`runner/program_store.py`): a key that changes with whatever changes the program, a round
trip that gives the same program back on its devices, and a file that cannot be read compiled again."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jengine.runner.program_store import (KEPT_INSTALLATIONS, ProgramStore, device_assignment, installation_identity,
                                          program_key, prune_installations)


@jax.jit
def affine(x, w):
    return x @ w + 1.0


def _args(rows: int = 4, devices=None):
    devices = devices or jax.devices()[:1]
    mesh = jax.sharding.Mesh(np.array(devices), ("tp",))
    x = jax.device_put(jnp.arange(rows * 8, dtype=jnp.float32).reshape(rows, 8), NamedSharding(mesh, P()))
    w = jax.device_put(jnp.ones((8, 4 * len(devices)), jnp.float32), NamedSharding(mesh, P(None, "tp")))
    return x, w


def test_the_key_follows_what_makes_the_program():
    base = program_key("affine", ("static",), _args())
    assert program_key("affine", ("static",), _args()) == base
    assert program_key("affine", ("other",), _args()) != base  # the static model
    assert program_key("affine", ("static",), _args(rows=8)) != base  # a shape
    assert program_key("affine", ("static",), _args(devices=jax.devices()[1:2])) != base  # the devices
    assert program_key("affine", ("static",), _args(devices=jax.devices()[:2])) != base  # the sharding
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), _args())
    assert program_key("affine", ("static",), abstract) == base  # abstract arguments key as their arrays
    assert len(installation_identity()) == 64


ROUND_TRIP = """
import json, sys
import jax, numpy as np
from tests.test_program_store import _args, affine
from jengine.runner.program_store import ProgramStore, device_assignment, program_key
args = _args(devices=jax.devices()[2:2 + int(sys.argv[2])])
compiled = affine.lower(*args).compile()
store, key = ProgramStore(__import__("pathlib").Path(sys.argv[1])), program_key("affine", (), args)
missing = store.load(key, device_assignment(args)) is None
store.save(key, compiled)
loaded = ProgramStore(store.directory.parent).load(key, device_assignment(args))
same = bool((np.asarray(loaded(*args)) == np.asarray(affine(*args))).all())
print(json.dumps({"missing_first": missing, "same": same,
                  "shardings": loaded.output_shardings == compiled.output_shardings}))
"""


@pytest.mark.parametrize("count", [1, 2])
def test_a_saved_program_comes_back_on_its_devices(tmp_path, count):
    """In a fresh process without JAX's persistent cache: XLA:CPU re-serializes an executable it took from that
    cache without the functions it compiled apart (the reason the store is off on the CPU)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    out = subprocess.run([sys.executable, "-c", ROUND_TRIP, str(tmp_path), str(count)], env=env, text=True,
                         capture_output=True, cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"missing_first": True, "same": True,
                                                                 "shardings": True}


def test_an_unreadable_file_is_compiled_again(tmp_path, caplog):
    args = _args()
    store, key = ProgramStore(tmp_path), program_key("affine", (), args)
    store.directory.mkdir(parents=True)
    (store.directory / key).write_bytes(b"not a program")
    with caplog.at_level(logging.WARNING, logger="jengine.runner.program_store"):
        assert store.load(key, device_assignment(args)) is None
    assert "compiling it" in caplog.text


def _installation(root: Path, name: str, used_at: float, size: int = 1000) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "program").write_bytes(b"x" * size)
    os.utime(folder, (used_at, used_at))
    return folder


def test_old_installations_are_removed_on_the_first_save(tmp_path, caplog):
    """Each upgrade keys a new folder: the first save of a process keeps its own and the most recently used
    others (KEPT_INSTALLATIONS in all), by when they were used, not by name, and removes the rest."""
    store = ProgramStore(tmp_path)
    store.directory.mkdir(parents=True)
    root = store.directory.parent
    used_at = [5, 1, 4, 2, 3]  # the folders named 0..4, used in this order of time
    olds = [_installation(root, f"{i:024x}", used_at=1_000_000 + t * 1000) for i, t in enumerate(used_at)]
    with caplog.at_level(logging.INFO, logger="jengine.runner.program_store"):
        store.save("key", object())  # not a program: the save fails (a warning), the pruning still runs
    newest = [olds[0], olds[2]]
    assert sorted(p.name for p in root.iterdir()) == sorted([store.directory.name, *(p.name for p in newest)])
    assert KEPT_INSTALLATIONS == 3
    assert caplog.text.count("removed the saved step programs of an older installation") == 3
    _installation(root, "f" * 24, used_at=0.0)
    store.save("key", object())  # once a process: nothing more is looked at
    assert (root / ("f" * 24)).exists()


def test_a_save_that_fails_leaves_no_part_behind(tmp_path, monkeypatch, caplog):
    """A full disk at the rename: a warning, and no partly written file left in the store."""
    from jax.experimental import serialize_executable

    store = ProgramStore(tmp_path)
    monkeypatch.setattr(serialize_executable, "serialize", lambda compiled: ("payload", None, None))

    def full_disk(*args):
        raise OSError("No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with caplog.at_level(logging.WARNING, logger="jengine.runner.program_store"):
        store.save("key", object())
    assert "could not save a step program" in caplog.text
    assert list(store.directory.iterdir()) == []


def test_pruning_passes_over_what_it_cannot_see(tmp_path):
    assert prune_installations(tmp_path / "missing", keep=tmp_path / "missing" / "x") == []
    keep = _installation(tmp_path, "current", used_at=1.0)  # the oldest by time, kept all the same
    others = [_installation(tmp_path, f"other{i}", used_at=100.0 + i) for i in range(3)]
    removed = prune_installations(tmp_path, keep=keep, count=2)
    assert keep.exists() and others[2].exists()
    assert sorted(removed) == sorted(others[:2])


def test_the_store_is_off_without_a_cache_and_on_the_cpu(tmp_path):
    assert ProgramStore.beside("", "gpu") is None
    assert ProgramStore.beside(str(tmp_path), "cpu") is None
    assert ProgramStore.beside(str(tmp_path), "gpu").directory.parent == tmp_path / "jengine-programs"


def test_the_store_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("JENGINE_PROGRAM_STORE", "off")
    assert ProgramStore.beside(str(tmp_path), "gpu") is None


def test_a_pinned_engine_serves_through_its_compiled_programs_as_a_lazy_one(build_checkpoint, tiny_tokenizer_dir):
    """`compile_buckets="all"` dispatches every step to the programs compiled at start-up (`StepPrograms`): the
    jits compile nothing more while it serves, and greedy and seeded outputs are the lazy engine's."""
    from transformers import LlamaConfig

    from jengine import LLM, SamplingParams
    from jengine.runner.step import num_compiled_shapes
    from tests.conftest import COMMON

    model = build_checkpoint(LlamaConfig(**{**COMMON, "num_hidden_layers": 2, "max_position_embeddings": 96}),
                             tokenizer_dir=tiny_tokenizer_dir)[0]
    options = dict(dtype="float32", max_model_len=96, max_num_seqs=6, max_num_batched_tokens=40, seed=0)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 9, 33, 4, 60)]
    params = [SamplingParams(temperature=0, max_tokens=7), SamplingParams(temperature=0.8, seed=5, max_tokens=7)]

    def serve(mode: str) -> list:
        with LLM(str(model), compile_buckets=mode, **options) as llm:
            before = num_compiled_shapes()
            outputs = [[o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] for p in params]
            return outputs, num_compiled_shapes() - before

    pinned, pinned_compiles = serve("all")
    lazy, _ = serve("lazy")
    assert pinned_compiles == 0
    assert pinned == lazy
