"""jengine: LLM inference and serving in JAX.

The public names load lazily (module `__getattr__`), so `import jengine` stays light and does not import jax; the
model and its device code load when an engine is built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jengine.config import EngineConfig
    from jengine.clients.async_engine import AsyncEngine
    from jengine.llm import LLM
    from jengine.lora.request import LoRARequest
    from jengine.outputs import CompletionOutput, Logprob, RequestOutput
    from jengine.sampling.params import SamplingParams, StructuredOutputsParams

_LAZY = {
    "LLM": "jengine.llm",
    "LoRARequest": "jengine.lora.request",
    "AsyncEngine": "jengine.clients.async_engine",
    "SamplingParams": "jengine.sampling.params",
    "StructuredOutputsParams": "jengine.sampling.params",
    "EngineConfig": "jengine.config",
    "RequestOutput": "jengine.outputs",
    "CompletionOutput": "jengine.outputs",
    "Logprob": "jengine.outputs",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    """Import the module that defines a public name on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jengine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
