"""What a finished (or streaming) request hands back: vLLM's result shapes, so notebook and server code ports as is.

A leaf module: plain dataclasses, no jax, nothing from the rest of jengine. Token ids come from the core; text,
stop handling and logprob dictionaries are built at the edge by `engine/output_processor`.
"""

from __future__ import annotations

import dataclasses
import enum


class RequestOutputKind(enum.Enum):
    """How much each `RequestOutput` of a request holds (vLLM's `RequestOutputKind`)."""

    CUMULATIVE = "cumulative"  # everything so far, each time (the whole text grows)
    DELTA = "delta"  # only what is new since the previous output (streaming servers)
    FINAL_ONLY = "final_only"  # a single output once the request has finished (`LLM.generate`)


@dataclasses.dataclass(frozen=True, slots=True)
class Logprob:
    """One token's raw log-probability, its 1-based rank in the model's distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""One dict per generated token: the chosen token plus the top-`logprobs` ones."""

PromptLogprobs = list[dict[int, Logprob] | None]
"""One entry per prompt token; the first is None (nothing precedes it to predict it from)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the model made, as OpenAI returns it: `arguments` is the JSON text of the arguments."""

    id: str
    name: str
    arguments: str
    type: str = "function"

    def to_openai(self) -> dict[str, object]:
        return {"id": self.id, "type": self.type, "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    """A chat choice's text as a reasoning and a tool-call parser read it: the reasoning span apart, the tool calls
    apart, what is left as `content` (None when nothing is)."""

    content: str | None
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclasses.dataclass
class CompletionOutput:
    """One choice (`index` of the request's `n`): its text, token ids and why it stopped."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS/length
    # `LLM.chat` under a reasoning or tool-call parser: the text read by them (finish_reason then "tool_calls" when
    # calls were made); None otherwise
    message: ChatMessage | None = None

    def finished(self) -> bool:
        """vLLM's spelling: a method, so `output.finished()` reads the same in ported code."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Times of one request's milestones, in `time.monotonic()` seconds (the core's clock), for latency figures."""

    arrival_time: float
    first_scheduled_time: float | None = None  # the core first scheduled it (a resumed preemption does not count)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival → the first generated token reached the front end."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """End-to-end latency: arrival → finished."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Waiting for a slot: arrival → first scheduled."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """First scheduled → first token (the prompt's computation, preemptions included)."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """First token → last token."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time


@dataclasses.dataclass
class RequestOutput:
    """Everything a request has produced so far (or since the last output, for delta outputs)."""

    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    metrics: RequestMetrics | None = None
