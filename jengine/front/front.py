"""`EngineFront`: what `LLM` and `AsyncEngine` share between their callers and the core.

Requests in: checked (`check`, the one validation of SamplingParams), tokenized and fanned out into one core request
per choice (`prepare`), tracked for output and handed to the core (`submit`). Core outputs out (`collect`): turned
into `RequestOutput`s, and the choices a stop string ended handed back to be stopped in the core. The clients keep
only what is theirs: admission and delivery (`AsyncEngine`'s slots and queues, `LLM`'s batch loop).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jengine.engine.core import EngineCoreOutput
from jengine.front.input_processor import InputProcessor, ProcessedRequest, PromptInput
from jengine.front.output_processor import OutputProcessor
from jengine.outputs import RequestOutput, RequestOutputKind
from jengine.request import Request
from jengine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from jengine.factory import EngineParts

EnterCore = Callable[[list[Request]], None]
"""Puts a request's choices (one core request each, carrying its choice index) into the core."""
StopInCore = Callable[[list[str]], Sequence[EngineCoreOutput] | None]
"""Stops these core requests in the core as FINISHED_STOPPED; returns what the core reports for them now, if it does."""


class EngineFront:
    """One engine's front; single-threaded (the caller serialises its calls)."""

    def __init__(self, processor: InputProcessor, output_kind: RequestOutputKind) -> None:
        self.processor = processor
        self._output_kind = output_kind
        self._output = OutputProcessor(processor.tokenizer)

    @classmethod
    def from_parts(cls, parts: EngineParts, max_n: int, output_kind: RequestOutputKind, *,
                   stop_at_context_end: bool = False) -> EngineFront:
        """The front of a built engine (`InputProcessor.from_parts` says what the limits are)."""
        return cls(InputProcessor.from_parts(parts, max_n, stop_at_context_end=stop_at_context_end), output_kind)

    @property
    def max_n(self) -> int:
        return self.processor.max_n

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size

    # ------------------------------------------------------------------ requests in
    def check(self, params: SamplingParams) -> None:
        """Validate the parameters (InvalidRequestError naming the field): before admission, before any text work."""
        self.processor.check_params(params)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile (into the cache) the grammar of a constrained request; any thread may call it."""
        self.processor.compile_grammar(params)

    def prepare(self, prompt: PromptInput, params: SamplingParams, request_id: str, *, priority: int = 0,
                arrival_time: float) -> ProcessedRequest:
        """Tokenize (chats rendered), check the prompt, resolve max_tokens, fan out; `params` passed `check`."""
        return self.processor.prepare(prompt, params, request_id, priority=priority, arrival_time=arrival_time)

    def process(self, prompt: PromptInput, params: SamplingParams, request_id: str, *,
                arrival_time: float) -> ProcessedRequest:
        """`check`, then `prepare`."""
        return self.processor.process(prompt, params, request_id, arrival_time=arrival_time)

    def process_chat(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams, request_id: str,
                     **options: Any) -> ProcessedRequest:
        """A conversation through the chat template (`InputProcessor.process_chat` names the options)."""
        return self.processor.process_chat(messages, params, request_id, **options)

    def submit(self, request: ProcessedRequest, enter: EnterCore) -> None:
        """Track the request's outputs, then put its choices into the core with `enter`."""
        self._output.add(request.request_id, request.prompt, request.prompt_token_ids, request.params,
                         request.child_ids, request.children[0].arrival_time, output_kind=self._output_kind)
        enter(request.children)

    # ------------------------------------------------------------------ outputs out
    def collect(self, core_outputs: list[EngineCoreOutput], stop: StopInCore) -> list[RequestOutput]:
        """The RequestOutputs these core outputs make; choices a stop string ended go to `stop`, and what the core
        reports for them afterwards is absorbed (those choices have finished here already)."""
        processed = self._output.process(core_outputs)
        if processed.requests_to_abort:
            self._output.process(list(stop(processed.requests_to_abort) or ()))
        return processed.request_outputs

    def remove(self, request_id: str) -> list[str]:
        """Forget a request (given up by its caller); returns its core request ids, to abort in the core."""
        return self._output.remove(request_id)

    def reset(self) -> None:
        """Forget every request (the engine died: nothing it holds will report back)."""
        self._output = OutputProcessor(self.processor.tokenizer)
