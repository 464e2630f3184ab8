"""What a newcomer meets first: the test extra leaves the base install's versions alone, the README states the true
download size, and a start without torch says nothing about PyTorch."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def test_the_test_extra_takes_ranges_and_never_narrows_the_base_install() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    for line in project["optional-dependencies"]["test"]:
        requirement = Requirement(line)
        assert not any(spec.operator in ("==", "===") for spec in requirement.specifier), line
        assert requirement.name not in base, f"{line}: the base install already chooses {base[requirement.name]}"


def test_the_readme_states_the_test_download_size() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "about 4.5 GB" in readme and "about 3 GB" not in readme


def test_no_pytorch_advice_when_torch_is_absent(tmp_path: Path) -> None:
    from jengine.tokenizer.tiny import CHATML_TEMPLATE, train_tiny_tokenizer

    train_tiny_tokenizer(tmp_path, vocab_size=300, chat_template=CHATML_TEMPLATE)
    script = ("import sys; sys.modules['torch'] = None\n"  # as in a serving image without torch
              "from jengine.tokenizer import Tokenizer\n"
              f"print(Tokenizer.from_pretrained({str(tmp_path)!r}).encode('hi'))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "PyTorch" not in result.stderr, result.stderr


def test_the_kv_cache_line_counts_whole_requests(caplog) -> None:
    import jax.numpy as jnp

    from jengine.runner.kv_storage import KVPlan, log_plan

    with caplog.at_level(logging.INFO):
        log_plan(KVPlan(32768, 16, 4096, "gpu_memory_utilization=0.92", jnp.dtype(jnp.bfloat16)), 2048)
    assert "256 requests of max_model_len=2048 fit at once" in caplog.text
