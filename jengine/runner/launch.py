"""How a step's kernels reach an NVIDIA GPU: XLA's command buffers (CUDA graphs), or each kernel launched on its own.

XLA records runs of a program's kernels into command buffers by default and launches each run as one graph. A graph
must be updated on the host when the buffers it was recorded with change, and it starts only once that is done;
kernels launched one by one start as the first is enqueued, so the device works while the host enqueues the rest.
Which mode serves a step faster is measured by `scripts/probe_graphs_gpu.py`; `EAGER_BY_DEFAULT` holds the answer
(XLA's command buffers until a measurement says otherwise), and `enforce_eager` (vLLM's name) asks for either mode.

The mode is a per-program XLA option (`compiler_options`), so it is part of each compiled program's identity: the
jits of both modes live side by side (`runner/step.py:STEP_JITS`) and the program store keys on the mode.
"""

from __future__ import annotations

# XLA option of the eager mode: no kind of command is recorded into command buffers
EAGER_OPTIONS: dict[str, str] = {"xla_gpu_enable_command_buffer": ""}
EAGER_BY_DEFAULT = False


def resolve_eager(platform: str, enforce_eager: bool | None) -> bool:
    """Whether the step programs launch their kernels one by one: as asked, else `EAGER_BY_DEFAULT` on a GPU. The
    CPU has no command buffers (the option changes nothing there): by default its programs keep the plain jits."""
    if enforce_eager is None:
        return platform == "gpu" and EAGER_BY_DEFAULT
    return enforce_eager
