"""docs/notebooks/quickstart.ipynb runs top to bottom on the CPU (nbclient, a fresh kernel on this source tree): the
LLM API on the demo model, streaming with AsyncEngine, and the throughput plot from `jengine bench`."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def test_the_quickstart_notebook_runs_on_the_cpu(monkeypatch) -> None:
    notebook = nbformat.read(ROOT / "docs" / "notebooks" / "quickstart.ipynb", as_version=4)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "deltas, finish_reason=length" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the throughput plot
