"""Core token ids → `RequestOutput`s: incremental text, stop strings, vLLM-shaped logprobs, per-request metrics.

Text never enters the core, so everything about text happens here, on the front end's side of the queue: each choice
(child request) is detokenized incrementally (UTF-8-safe), stop strings are searched in the newly added tail only
(a match may span tokens and steps), and streamed text holds back the last `max_stop_len - 1` characters until they
cannot be the start of a stop string. A stop-string hit finishes the choice here; the caller aborts it in the core.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from jengine.engine.core import EngineCoreOutput
from jengine.outputs import (
    CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput, RequestOutputKind, SampleLogprobs,
)
from jengine.sampling.params import SamplingParams
from jengine.scheduler.output import TokenLogprobs
from jengine.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

DecodeToken = Callable[[int], str]


@dataclasses.dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]  # one per parent request with something new (per its output kind)
    requests_to_abort: list[str]  # child ids ended by a stop string that the core still runs: abort as STOPPED


def find_stop_string(text: str, num_new_chars: int, stops: Sequence[str], include: bool) -> tuple[str, int] | None:
    """(stop string, where the text ends) for the earliest stop string that ends in the last `num_new_chars`.

    Only the tail that can hold a new match is searched, so the cost per step does not grow with the text.
    """
    best: tuple[str, int] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        found = text.find(stop, start)
        if found != -1 and (best is None or found < best[1]):
            best = (stop, found)
    if best is None:
        return None
    stop, found = best
    return stop, found + len(stop) if include else found


def logprob_dict(entry: TokenLogprobs, num_top: int, decode: DecodeToken) -> dict[int, Logprob]:
    """vLLM's shape for one position: the chosen token (its true rank) then the top `num_top` (ranks 1..num_top)."""
    chosen = entry.token_ids[0]
    out = {chosen: Logprob(entry.logprobs[0], entry.chosen_rank, decode(chosen))}
    tops = zip(entry.token_ids[1 : 1 + num_top], entry.logprobs[1 : 1 + num_top])
    for rank, (token, logprob) in enumerate(tops, start=1):
        out.setdefault(token, Logprob(logprob, rank, decode(token)))
    return out


class _ChoiceState:
    """One choice: its detokenizer, text with stop strings applied, tokens, logprobs, and what was already sent."""

    def __init__(self, index: int, params: SamplingParams, detok: IncrementalDetokenizer | None,
                 decode: DecodeToken) -> None:
        self.index = index
        self.params = params
        self._detok = detok
        self._decode = decode
        self._stops: tuple[str, ...] = tuple(params.stop or ())
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._sent_chars = self._sent_tokens = 0
        self._sent_finished = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput) -> bool:
        """Apply one core output; True when a stop string ended this choice while the core still runs it."""
        if self.finished:
            return False
        tokens = list(out.new_token_ids)
        self.token_ids.extend(tokens)
        self._add_logprobs(out.logprobs, len(tokens))
        by_stop_token = out.finish_reason == "stop" and bool(tokens)  # the core ended it on EOS / a stop token
        delta = self._detokenize(tokens, by_stop_token, out.finish_reason is not None)
        if self._apply_stop_strings(delta):
            return out.finish_reason is None
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            if by_stop_token and tokens[-1] in (self.params.stop_token_ids or ()):
                self.stop_reason = tokens[-1]
        return False

    def _add_logprobs(self, entries: Sequence[TokenLogprobs | None], num_tokens: int) -> None:
        if self.logprobs is None:
            return
        for i in range(num_tokens):
            entry = entries[i] if i < len(entries) else None
            if entry is None:  # the core owes one per token; keep the one-dict-per-token shape regardless
                logger.warning("missing logprobs for a generated token")
                self.logprobs.append({})
                continue
            self.logprobs.append(logprob_dict(entry, self.params.logprobs or 0, self._decode))
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + entry.logprobs[0]

    def _detokenize(self, tokens: list[int], by_stop_token: bool, finishing: bool) -> str:
        """New text; the EOS/stop token that ended the choice is left out unless include_stop_str_in_output."""
        if self._detok is None:
            return ""
        if by_stop_token and not self.params.include_stop_str_in_output:
            tokens = tokens[:-1]
        delta = self._detok.push(tokens)
        return delta + self._detok.finish() if finishing else delta

    def _apply_stop_strings(self, delta: str) -> bool:
        """Append `delta`; on a stop string, trim the text there and finish with stop_reason = the string."""
        self.text += delta
        if not delta or not self._stops or len(self.token_ids) <= self.params.min_tokens:
            return False  # vLLM's rule: stop strings count only after min_tokens
        hit = find_stop_string(self.text, len(delta), self._stops, self.params.include_stop_str_in_output)
        if hit is None:
            return False
        stop, end = hit
        self.text = self.text[:end]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def _releasable(self) -> int:
        """Characters that may be shown: all once finished, else all but a possible stop-string start."""
        if self.finished or not self._hold:
            return len(self.text)
        return max(self._sent_chars, len(self.text) - self._hold)

    def take_output(self, kind: RequestOutputKind) -> CompletionOutput | None:
        """This choice's output (everything, or the news for DELTA; None when a delta would be empty)."""
        end = self._releasable()
        start_chars, start_tokens = (self._sent_chars, self._sent_tokens) if kind is RequestOutputKind.DELTA else (0, 0)
        news = end > self._sent_chars or len(self.token_ids) > self._sent_tokens or self.finished != self._sent_finished
        if kind is RequestOutputKind.DELTA and not news:
            return None
        self._sent_chars, self._sent_tokens, self._sent_finished = end, len(self.token_ids), self.finished
        logprobs = None if self.logprobs is None else self.logprobs[start_tokens:]
        return CompletionOutput(self.index, self.text[start_chars:end], self.token_ids[start_tokens:],
                                self.cumulative_logprob, logprobs, self.finish_reason, self.stop_reason)


class _ParentState:
    """One user request: its choices, prompt logprobs (from choice 0) and metrics."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 child_ids: list[str], choices: list[_ChoiceState], kind: RequestOutputKind,
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.child_ids = child_ids
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.choices = choices
        self.kind = kind
        self.metrics = RequestMetrics(arrival_time)
        self.prompt_logprobs: PromptLogprobs | None = [] if params.prompt_logprobs is not None else None
        self._sent_prompt_logprobs = 0
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def update(self, choice: _ChoiceState, out: EngineCoreOutput, decode: DecodeToken) -> bool:
        """Apply a core output of one choice; True when the core must stop that choice (a stop-string hit)."""
        if choice.index == 0:
            self.num_cached_tokens = out.num_cached_tokens
            self._add_prompt_logprobs(out.prompt_logprobs, decode)
        if out.first_scheduled_time is not None:  # the earliest of its choices
            known = self.metrics.first_scheduled_time
            self.metrics.first_scheduled_time = (out.first_scheduled_time if known is None
                                                 else min(known, out.first_scheduled_time))
        if out.new_token_ids and not choice.finished:
            if self.metrics.first_token_time is None:
                self.metrics.first_token_time = out.timestamp
            self.metrics.last_token_time = out.timestamp
        must_abort = choice.update(out)
        if self.finished and self.metrics.finished_time is None:
            self.metrics.finished_time = out.timestamp
        return must_abort

    def _add_prompt_logprobs(self, entries: list[TokenLogprobs | None] | None, decode: DecodeToken) -> None:
        if self.prompt_logprobs is None or not entries:
            return
        if not self.prompt_logprobs and entries[0] is not None:
            self.prompt_logprobs.append(None)  # nothing predicts the first prompt token
        num_top = self.params.prompt_logprobs or 0
        self.prompt_logprobs.extend(None if e is None else logprob_dict(e, num_top, decode) for e in entries)

    def take_output(self) -> RequestOutput | None:
        """The output this request's kind calls for now, or None (nothing new, or not finished for FINAL_ONLY)."""
        if self.kind is RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        kind = RequestOutputKind.CUMULATIVE if self.kind is RequestOutputKind.FINAL_ONLY else self.kind
        outputs = [o for o in (c.take_output(kind) for c in self.choices) if o is not None]
        prompt_logprobs = self._take_prompt_logprobs()
        if not outputs and not prompt_logprobs:
            return None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, prompt_logprobs, outputs,
                             self.finished, self.num_cached_tokens, self.metrics)

    def _take_prompt_logprobs(self) -> PromptLogprobs | None:
        """All of them, or for DELTA the part not sent yet (None when none is new)."""
        if self.prompt_logprobs is None:
            return None
        if self.kind is not RequestOutputKind.DELTA:
            return list(self.prompt_logprobs)
        new = self.prompt_logprobs[self._sent_prompt_logprobs :]
        self._sent_prompt_logprobs = len(self.prompt_logprobs)
        return new or None


class OutputProcessor:
    """Turns core outputs into `RequestOutput`s for the requests it was told about; single-threaded."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        self._children: dict[str, tuple[_ParentState, _ChoiceState]] = {}
        self._token_text: dict[int, str] = {}  # decoded single tokens for logprobs; bounded by the vocabulary

    def add(
        self,
        parent_request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_ids: list[str],
        arrival_time: float,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        """Track a request whose children (`child_ids`, in choice order) are about to enter the core."""
        if parent_request_id in self._parents or any(c in self._children for c in child_ids):
            raise ValueError(f"request {parent_request_id!r} is already being processed")
        choices = [_ChoiceState(i, params, self._detokenizer(prompt_token_ids, params), self._decode_token)
                   for i in range(len(child_ids))]
        parent = _ParentState(parent_request_id, prompt, prompt_token_ids, params, list(child_ids), choices,
                              output_kind, arrival_time)
        self._parents[parent_request_id] = parent
        self._children.update({cid: (parent, choice) for cid, choice in zip(child_ids, choices)})

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one batch of core outputs; outputs for unknown (removed or finished) children are ignored."""
        touched: dict[str, _ParentState] = {}
        to_abort: list[str] = []
        for out in core_outputs:
            entry = self._children.get(out.request_id)
            if entry is None:
                continue
            parent, choice = entry
            if parent.update(choice, out, self._decode_token):
                to_abort.append(out.request_id)
            touched[parent.request_id] = parent
        request_outputs = [o for o in (p.take_output() for p in touched.values()) if o is not None]
        for parent in touched.values():
            if parent.finished:
                self.remove(parent.request_id)
        return ProcessedOutputs(request_outputs, to_abort)

    def remove(self, parent_request_id: str) -> list[str]:
        """Forget a request (finished, or given up by its caller); returns its child ids."""
        parent = self._parents.pop(parent_request_id, None)
        if parent is None:
            return []
        for cid in parent.child_ids:
            self._children.pop(cid, None)
        return parent.child_ids

    def has_request(self, parent_request_id: str) -> bool:
        return parent_request_id in self._parents

    def num_requests(self) -> int:
        """Requests not finished yet (parents)."""
        return len(self._parents)

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if not params.detokenize:
            return None
        return IncrementalDetokenizer(self._tokenizer, prompt_token_ids, params.skip_special_tokens,
                                      params.spaces_between_special_tokens)

    def _decode_token(self, token_id: int) -> str:
        """One token's text for logprobs, special tokens shown (decoded once per id)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text
