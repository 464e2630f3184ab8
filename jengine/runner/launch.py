"""How a step's kernels reach an NVIDIA GPU: XLA's command buffers (CUDA graphs), or each kernel launched on its own.

XLA records runs of a program's kernels into command buffers by default and launches each run as one graph: the host
enqueues one launch where it would enqueue dozens, which is what a short, host-bound step needs (an MoE decode step
at batch 1, 24 layers of Qwen3-30B-A3B: 2.85 ms with them, 4.25 ms without, on one H100). A graph starts only once
the host has brought it up to date with the step's buffers, while kernels launched one by one start as the first is
enqueued and run while the host enqueues the rest: a long step that runs once, a prompt chunk's, starts sooner that
way (a prefix-cache hit's TTFT 10.4-10.6 ms eager against 11.3 ms with command buffers, same H100; an 8B decode
step, bound by the device, 6.03 against 6.08 ms). So by default steps of up to GRAPH_MAX_QUERY_LEN new tokens a
request (decodes) and speculative verification steps (which run every decode iteration) keep the command buffers and
prompt chunks launch eagerly, as vLLM captures CUDA graphs for decode batches and runs prefills eagerly;
`enforce_eager` (vLLM's name) asks for one mode everywhere.
Measured by `scripts/probe_graphs_gpu.py` and `scripts/probe_ttft_host_gpu.py` (benchmarks/README.md).

The mode is a per-program XLA option (`compiler_options`), so it is part of each compiled program's identity: the
jits of both modes live side by side (`runner/step.py:STEP_JITS`) and the program store keys on the mode.
"""

from __future__ import annotations

import dataclasses

# XLA option of the eager mode: no kind of command is recorded into command buffers
EAGER_OPTIONS: dict[str, str] = {"xla_gpu_enable_command_buffer": ""}
GRAPH_MAX_QUERY_LEN = 16  # the longest step (new tokens a request) that keeps command buffers by default


@dataclasses.dataclass(frozen=True)
class LaunchPolicy:
    """Which step programs launch their kernels one by one: those whose `max_query_len` exceeds `eager_above`
    (None: none of them)."""

    eager_above: int | None = None

    def eager_for(self, max_query_len: int) -> bool:
        return self.eager_above is not None and max_query_len > self.eager_above

    @property
    def eager_sampler(self) -> bool:
        """The sampler program's mode: eager only where every step is (it is a few launches after the forward)."""
        return self.eager_for(1)


def launch_policy(platform: str, enforce_eager: bool | None) -> LaunchPolicy:
    """`enforce_eager` True: every step eager; False: every step with command buffers; None: on a GPU, eager above
    GRAPH_MAX_QUERY_LEN. The CPU has no command buffers (the option changes nothing there): by default its programs
    keep the plain jits."""
    if enforce_eager is None:
        return LaunchPolicy(GRAPH_MAX_QUERY_LEN if platform == "gpu" else None)
    return LaunchPolicy(0 if enforce_eager else None)
