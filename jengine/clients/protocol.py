"""`EngineClient`: the only face of the engine that servers see.

The in-process `AsyncEngine` satisfies it, and so can a gRPC-backed client (`jengine openai --engine HOST:PORT`),
so the OpenAI shim runs unchanged over either. Errors cross it as the `jengine.errors` hierarchy only.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Container
from typing import Any, Protocol, runtime_checkable

from jengine.config import ChatParsingConfig
from jengine.errors import InvalidRequestError

from jengine.engine.stats import EngineStats
from jengine.front.input_processor import PromptInput
from jengine.lora.request import LoRARequest
from jengine.outputs import RequestOutput
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a server reports about the model it serves (/v1/models, limits in error messages)."""

    name: str  # served model name (what clients put in "model")
    path: str  # the model directory
    max_model_len: int
    vocab_size: int  # the ids a request may use: the smaller of the tokenizer's and the model's
    max_logprobs: int
    # SamplingParams keywords a request's unset fields take (the model's generation_config.json; may be empty)
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    aliases: tuple[str, ...] = ()  # further names clients may put in "model"
    # core requests (choices) the engine holds at once, running or queued; 0 where unknown (a remote engine)
    max_in_flight: int = 0
    chat_parsing: ChatParsingConfig = ChatParsingConfig()  # how chat replies are read (reasoning, tool calls)


@runtime_checkable
class EngineClient(Protocol):
    """Submit, stream, abort; plus what servers need to describe the model and report health."""

    def generate(self, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, *, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream delta outputs of one request; the last has finished=True. Raises InvalidRequestError,
        CapacityError (full: retry later) or EngineDeadError; stopping the iteration aborts the request.

        Admission (the slot reservation) happens synchronously in the first `__anext__`, before any tokenising, so
        a caller can start that step eagerly to learn at once whether the request was taken. A chat is passed as
        `{"messages": [...], "add_generation_prompt": bool}` and rendered after admission too."""
        ...

    async def abort(self, request_id: str) -> None:
        """End a request early (its stream ends with finish_reason "abort"); unknown ids are ignored."""
        ...

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (chat templates, /tokenize)."""
        ...

    def get_model_info(self) -> ModelInfo:
        ...

    def is_healthy(self) -> bool:
        """False once the engine is dead (servers answer /health with 503 then)."""
        ...

    def stats(self) -> EngineStats:
        """The latest published snapshot (read-only, cheap, callable from any thread)."""
        ...

    def shutdown(self) -> None:
        ...


@runtime_checkable
class LoraClient(Protocol):
    """An engine client that serves LoRA adapters (the in-process engine): `generate` takes `lora_request=`."""

    def list_loras(self) -> list[LoRARequest]:
        """The adapters requests may name, in the order they were added."""
        ...

    def allows_runtime_lora_updating(self) -> bool:
        """Whether adapters may be loaded and unloaded while serving (VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
        ...

    async def add_lora(self, request: LoRARequest) -> None:
        """Read and check an adapter (AdapterError when it cannot be served); then requests may name it."""
        ...

    async def remove_lora(self, name: str) -> None:
        """Forget an adapter; refused (InvalidRequestError, code lora_in_use) while requests use it."""
        ...


def request_in_use(request_id: str) -> InvalidRequestError:
    """The error for a request id that another live request of the same client holds."""
    return InvalidRequestError(f"request id {request_id[:100]!r} is already in use", param="request_id")


def request_identity(sampling_params: SamplingParams | None, request_id: str | None,
                     in_use: Container[str]) -> tuple[SamplingParams, str]:
    """A request's parameters (the defaults when none) and its id (a fresh one when none); an id in use is refused."""
    request_id = request_id or uuid.uuid4().hex
    if request_id in in_use:
        raise request_in_use(request_id)
    return sampling_params or SamplingParams(), request_id
