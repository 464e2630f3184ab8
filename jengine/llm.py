"""`LLM`: the notebook API in vLLM's shape: `LLM(model, **engine_args).generate(prompts, SamplingParams(...))`.

Synchronous and single-threaded: it owns the core and steps it itself, no loop thread. Every prompt is validated and
tokenized before the first step, so a bad prompt in a batch raises and leaves nothing in the engine. Prompts then go
into the core as slots free up (at most `max_num_seqs + max_num_queued_reqs` core requests at a time), so any number
of prompts can be given in one call.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import numbers
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from jengine.config import EngineConfig
from jengine.engine.core import EngineCoreOutput
from jengine.front.front import EngineFront
from jengine.front.input_processor import ProcessedRequest, PromptInput
from jengine.errors import EngineDeadError, InvalidRequestError
from jengine.lora.request import LoRARequest
from jengine.outputs import RequestOutput, RequestOutputKind
from jengine.progress import progress_bar
from jengine.request import Request, RequestStatus
from jengine.sampling.defaults import max_tokens_when_unset
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import Tokenizer
from jengine.tools.request import ChatParsing, parse_tools, with_forced_calls
from jengine.tools.stream import finish_reason

OFFLINE_MAX_N = 1024  # choices per prompt offline (pass@k wants many); servers keep their own, smaller cap

if TYPE_CHECKING:
    from jengine.factory import EngineParts

logger = logging.getLogger(__name__)

Conversation = Sequence[Mapping[str, Any]]
ParamsArg = SamplingParams | Sequence[SamplingParams] | None
LoraArg = LoRARequest | Sequence[LoRARequest | None] | None


class LLM:
    """An engine for offline batches; `shutdown()` (or `with LLM(...) as llm:`) frees it for the next one."""

    def __init__(self, model: str | Path | None = None, *, revision: str | None = None,
                 download_dir: str | Path | None = None, **engine_args: Any) -> None:
        """`model`: a checkpoint directory, a Hugging Face model id (`revision`, `download_dir` as vLLM's), or
        none / "jengine-demo-tiny-random" for the demo model. Every engine flag is a keyword of the same name
        (`max_model_len=`, `max_num_seqs=`, `dtype=`, ...)."""
        from jengine.factory import build_engine, build_replicated_engine  # imports jax: only here
        from jengine.models.hub import resolve_model, resolve_tokenizer

        resolved = resolve_model(model, revision=revision, download_dir=download_dir)
        engine_args.setdefault("served_model_name", resolved.name)
        engine_args["tokenizer"] = resolve_tokenizer(engine_args.get("tokenizer"), download_dir=download_dir)
        config = EngineConfig.from_kwargs(resolved.path, **engine_args)
        build = build_replicated_engine if config.parallel.data_parallel_size > 1 else build_engine
        self._setup(build(config))

    @classmethod
    def from_parts(cls, parts: EngineParts) -> LLM:
        """An LLM over an already built engine (or a fake core in tests)."""
        llm = cls.__new__(cls)
        llm._setup(parts)
        return llm

    def _setup(self, parts: EngineParts) -> None:
        self._parts = parts
        self._core = parts.core
        self._front = EngineFront.from_parts(parts, OFFLINE_MAX_N, RequestOutputKind.FINAL_ONLY,
                                             stop_at_context_end=True)
        sched = parts.config.scheduler
        self._bound = sched.max_num_seqs + sched.max_num_queued_reqs
        self._ids = itertools.count()
        self._dead: EngineDeadError | None = None

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: PromptInput | Sequence[PromptInput], sampling_params: ParamsArg = None, *,
                 use_tqdm: bool = True, lora_request: LoraArg = None) -> list[RequestOutput]:
        """Complete every prompt; results in input order. A prompt: str, token ids (a list or a 1-D array),
        {"prompt" or "prompt_token_ids"}. `lora_request`: one `LoRARequest` for every prompt or a list aligned with
        the prompts (None: the base model); each adapter is read and checked before any prompt runs."""
        self._raise_if_dead()
        batch = [_as_plain_prompt(p) for p in _as_prompt_list(_as_plain_prompt(prompts))]
        params = _params_per_prompt(sampling_params, len(batch), self.get_default_sampling_params())
        adapters = self._adapters_per_prompt(lora_request, len(batch))
        now = time.monotonic()
        requests = [self._front.process(p, sp, self._next_id(), arrival_time=now) for p, sp in zip(batch, params)]
        return self._run(_with_adapters(requests, adapters), use_tqdm)

    def _adapters_per_prompt(self, lora_request: LoraArg, count: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            adapters = [lora_request] * count
        elif isinstance(lora_request, Sequence) and not isinstance(lora_request, str):
            adapters = list(lora_request)
            if len(adapters) != count:
                raise InvalidRequestError(f"got {len(adapters)} lora_request entries for {count} prompts",
                                          param="lora_request")
        else:
            raise InvalidRequestError(f"lora_request must be a LoRARequest, a list of them or None, got "
                                      f"{type(lora_request).__name__}", param="lora_request")
        for adapter in adapters:
            if adapter is not None and not isinstance(adapter, LoRARequest):
                raise InvalidRequestError(f"lora_request entries must be LoRARequest or None, got "
                                          f"{type(adapter).__name__}", param="lora_request")
            if adapter is not None:
                self._core.add_lora(adapter)
        return adapters

    def chat(self, messages: Conversation | Sequence[Conversation], sampling_params: ParamsArg = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
             use_tqdm: bool = True, lora_request: LoraArg = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template.
        `continue_final_message` (with add_generation_prompt=False) continues the last message instead of starting
        a new turn; `chat_template_kwargs` are extra template variables (e.g. {"enable_thinking": False});
        `lora_request` as in `generate`. `tools` (OpenAI function tools) are listed by the template. With
        `LLM(..., reasoning_parser=...)` or `tool_call_parser=...` each output's `message` holds the reply read apart
        (reasoning, content, tool calls; finish_reason "tool_calls" when it made calls); `tool_choice` "none" leaves
        calls unread, "required" or a named function constrains the reply to calls (read whatever the parsers)."""
        self._raise_if_dead()
        conversations = _as_conversation_list(messages)
        params = _params_per_prompt(sampling_params, len(conversations), self.get_default_sampling_params())
        adapters = self._adapters_per_prompt(lora_request, len(conversations))
        tool_request = parse_tools(tools, tool_choice)
        constrained = any(sp.structured_outputs is not None for sp in params)
        parsing = ChatParsing.plan_offline(self._parts.config.chat_parsing, tool_request, constrained)
        params = [with_forced_calls(sp, tool_request) for sp in params]
        if parsing is not None:
            params = [sp.clone(structured_outputs=parsing.structured(sp.structured_outputs)) for sp in params]
        if parsing is not None and parsing.needs_special_tokens:
            params = [dataclasses.replace(sp, skip_special_tokens=False) for sp in params]
        now = time.monotonic()
        requests = [
            self._front.process_chat(c, sp, self._next_id(), chat_template=chat_template,
                                     add_generation_prompt=add_generation_prompt,
                                     continue_final_message=continue_final_message,
                                     chat_template_kwargs=chat_template_kwargs,
                                     tools=list(tool_request.tools) if tool_request else None, arrival_time=now)
            for c, sp in zip(conversations, params)
        ]
        results = self._run(_with_adapters(requests, adapters), use_tqdm)
        if parsing is not None:
            for result, sp in zip(results, params):
                reading = dataclasses.replace(parsing, constrained=sp.structured_outputs is not None)
                for output in result.outputs:
                    output.message = reading.read(result.prompt, output.text)
                    output.finish_reason = finish_reason(output.finish_reason, output.message)
        return results

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without sampling_params: the model's generation_config.json defaults
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), else SamplingParams()."""
        defaults = self._parts.sampling_defaults
        return SamplingParams(**{**defaults, "max_tokens": max_tokens_when_unset(defaults, "offline")})

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix, so the next prompts are computed in full (vLLM's name). Between
        `generate` calls nothing holds blocks, so it succeeds; True when done."""
        self._raise_if_dead()
        return self._core.reset_prefix_cache()

    def get_tokenizer(self) -> Tokenizer:
        return self._parts.tokenizer

    def shutdown(self) -> None:
        """Free the engine (device memory with it); further calls raise EngineDeadError."""
        if self._dead is None:
            self._dead = EngineDeadError("this LLM was shut down")
            self._core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the batch loop
    def _run(self, requests: list[ProcessedRequest], use_tqdm: bool) -> list[RequestOutput]:
        """Feed, step, collect until every request has finished; on any interruption abort what is left."""
        pending = collections.deque(requests)
        results: dict[str, RequestOutput] = {}
        added: list[ProcessedRequest] = []
        progress = _Progress(len(requests), use_tqdm)
        try:
            while len(results) < len(requests):
                self._feed(pending, added)
                self._collect(self._step(), results, progress)
                self._check_progress(pending, results, len(requests))
        except BaseException:
            self._abandon([r for r in added if r.request_id not in results])
            raise
        finally:
            progress.close()
        return [results[r.request_id] for r in requests]

    def _feed(self, pending: collections.deque[ProcessedRequest], added: list[ProcessedRequest]) -> None:
        """Move prompts into the core while it holds fewer than the bound (one always fits an empty core)."""
        while pending:
            held = self._core.num_requests()
            if held and held + len(pending[0].children) > self._bound:
                return
            request = pending.popleft()
            self._front.submit(request, self._enter_core)
            added.append(request)

    def _enter_core(self, children: list[Request]) -> None:
        """Into the core past its own queue bound: `_feed` keeps this call's total under it."""
        for child in children:
            self._core.add_request(child, enforce_queue_bound=False)

    def _step(self) -> list[EngineCoreOutput]:
        """One core step; a failing core leaves the engine in an unknown state, so the LLM is dead afterwards."""
        try:
            return self._core.step()
        except Exception as exc:
            self._dead = EngineDeadError(f"the engine step failed ({type(exc).__name__})")
            raise self._dead from exc

    def _collect(self, core_outputs: list[EngineCoreOutput], results: dict[str, RequestOutput],
                 progress: _Progress) -> None:
        """Outputs → finished results; stop-string hits are stopped in the core (their outputs are then ignored)."""
        for output in self._front.collect(core_outputs, self._stop_in_core):
            results[output.request_id] = output
            progress.finished(output)

    def _stop_in_core(self, child_ids: list[str]) -> list[EngineCoreOutput]:
        return self._core.abort(child_ids, RequestStatus.FINISHED_STOPPED)

    def _check_progress(self, pending: collections.deque[ProcessedRequest], results: dict[str, RequestOutput],
                        total: int) -> None:
        """A core with no work while results are missing would loop forever: fail loudly instead."""
        if not pending and len(results) < total and not self._core.has_unfinished():
            raise RuntimeError("the engine finished all its requests but some results never arrived")

    def _abandon(self, requests: list[ProcessedRequest]) -> None:
        """Abort this call's unfinished requests so the engine is clean for the next call (e.g. after Ctrl-C)."""
        if self._dead is not None:
            return
        child_ids = [cid for r in requests for cid in self._front.remove(r.request_id)]
        self._core.abort(child_ids, RequestStatus.FINISHED_ABORTED)

    def _next_id(self) -> str:
        return str(next(self._ids))

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))


class _Progress:
    """A tqdm bar over prompts with input/output token throughput in the postfix."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = progress_bar(total=total, desc="Processed prompts", dynamic_ncols=True, enabled=enabled)
        self._start = time.perf_counter()
        self._in_tokens = self._out_tokens = 0

    def finished(self, output: RequestOutput) -> None:
        self._in_tokens += len(output.prompt_token_ids)
        self._out_tokens += sum(len(c.token_ids) for c in output.outputs)
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        speeds = f"input: {self._in_tokens / elapsed:.2f} toks/s, output: {self._out_tokens / elapsed:.2f} toks/s"
        self._bar.set_postfix_str(f"est. speed {speeds}", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def _is_token_list(value: Any) -> bool:
    """A non-empty sequence of integers: one prompt of token ids (a list of prompts never holds bare ints)."""
    return isinstance(value, Sequence) and not isinstance(value, str) and bool(value) and all(
        isinstance(t, numbers.Integral) for t in value
    )


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt (a str, a dict, or a list of token ids) or a list of prompts → a list of prompts."""
    if isinstance(prompts, (str, Mapping)) or _is_token_list(prompts):
        return [prompts]
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise InvalidRequestError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}",
                              param="prompt")


def _as_plain_prompt(prompt: Any) -> Any:
    """A 1-D array of token ids (numpy, jax) as a list; vLLM's prompt dict keys that ask for nothing dropped."""
    if hasattr(prompt, "tolist") and getattr(prompt, "ndim", None) == 1:
        return prompt.tolist()
    if isinstance(prompt, Mapping) and any(prompt.get(k) is None for k in _EMPTY_PROMPT_KEYS if k in prompt):
        return {k: v for k, v in prompt.items() if not (k in _EMPTY_PROMPT_KEYS and v is None)}
    return prompt


_EMPTY_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "cache_salt")


def _as_conversation_list(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation (a list of message dicts) or a list of conversations → a list of conversations."""
    if isinstance(messages, Sequence) and not isinstance(messages, str):
        if messages and all(isinstance(m, Mapping) for m in messages):
            return [messages]  # type: ignore[list-item]
        return list(messages)  # type: ignore[arg-type]
    raise InvalidRequestError("messages must be a list of messages or a list of conversations", param="messages")


def _with_adapters(requests: list[ProcessedRequest], adapters: list[LoRARequest | None]) -> list[ProcessedRequest]:
    """Each request's choices run under its adapter (None: the base model)."""
    for request, adapter in zip(requests, adapters, strict=True):
        for child in request.children:
            child.lora_request = adapter
    return requests


def _params_per_prompt(params: ParamsArg, count: int, default: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams for all prompts, or one per prompt (the lengths must match); `default` for None."""
    if params is None:
        return [default] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if isinstance(params, (Mapping, str)):
        raise InvalidRequestError(f"sampling_params must be SamplingParams or a list of them, got "
                                  f"{type(params).__name__} (SamplingParams(**d) builds one from a dict)",
                                  param="sampling_params")
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError(f"got {len(params)} sampling_params for {count} prompts", param="sampling_params")
    return params
