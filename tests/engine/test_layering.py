"""The engine core moves token ids only: importing it must not pull in the text side (tokenizer, templates, HF)."""

import subprocess
import sys

import pytest

TEXT_SIDE = ("jengine.tokenizer", "jengine.front", "jengine.clients", "jinja2", "tokenizers", "transformers", "jax")


@pytest.mark.parametrize("module", ["jengine.engine.core", "jengine.engine.core_loop", "jengine.engine.routing",
                                    "jengine.scheduler"])
def test_core_imports_no_text_side(module: str) -> None:
    probe = (f"import sys, {module}; "
             f"print(' '.join(m for m in {TEXT_SIDE!r} if any(k == m or k.startswith(m + '.') for k in sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == [], f"importing {module} loaded {loaded}"
