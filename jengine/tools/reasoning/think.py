"""`<think>` ... `</think>` reasoning spans (Qwen3, QwQ, DeepSeek-R1 and its distills).

The span's text is the reasoning (whitespace at its ends dropped); what follows `</think>` is the content (leading
whitespace dropped). The parsers differ in where a reply starts:

- `qwen3`: in content, unless the reply opens with `<think>` or the prompt itself ended inside an open `<think>`
  (Qwen3's thinking templates); `enable_thinking: false` (through `chat_template_kwargs`) closes the span in the
  prompt, so the reply is all content.
- `deepseek_r1`: in reasoning (R1 thinks first, and newer templates open `<think>` in the prompt); a leading
  `<think>` is read past; a reply cut before `</think>` is all reasoning.
- both: a prompt that ends with a closed span (`</think>`: templates that turn thinking off) starts the reply in
  content; a structured-output reply (its grammar applies once the reasoning ends) starts in reasoning otherwise.

Like the tool-call parsers, `scan(text, final)` is a pure reading whose results only grow as the text does: a tag
arriving split across tokens is held back, so markup never reaches the content.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jengine.tools.json_scan import held_prefix, skip_whitespace

OPEN, CLOSE = "<think>", "</think>"


@dataclasses.dataclass
class ReasoningScan:
    reasoning: str = ""
    content: str = ""
    thinking: bool = False  # the reply has (so far) a reasoning span


class ReasoningParser:
    name: ClassVar[str]
    starts_in_reasoning: ClassVar[bool] = False

    def __init__(self, prompt: str | None = None, constrained: bool = False) -> None:
        """`constrained`: the reply's content is grammar-constrained, and the grammar waits for the end of the
        reasoning (`reply_in_reasoning`), so the reply is read as starting in reasoning too."""
        self.closed_by_prompt = prompt_closed_reasoning(prompt)  # e.g. enable_thinking=false: an empty span
        self.opened_by_prompt = prompt is not None and prompt.rstrip().endswith(OPEN)
        self.reply_in_reasoning = not self.closed_by_prompt and (self.starts_in_reasoning or self.opened_by_prompt
                                                                 or constrained)

    def extract(self, text: str) -> ReasoningScan:
        """The non-streaming reading of a whole reply."""
        return self.scan(text, final=True)

    def scan(self, text: str, final: bool) -> ReasoningScan:
        start = skip_whitespace(text, 0)
        if text.startswith(OPEN, start):
            return _reasoning(text, start + len(OPEN), final)
        if not final and OPEN.startswith(text[start:]):
            return ReasoningScan(thinking=self.reply_in_reasoning)  # may still open
        if self.reply_in_reasoning:
            return _reasoning(text, 0, final)
        return ReasoningScan(content=text)


def prompt_closed_reasoning(prompt: str | None) -> bool:
    """The prompt ends with a closed span (templates that turn thinking off write an empty one): the reply starts
    in content."""
    return prompt is not None and prompt.rstrip().endswith(CLOSE)


def _reasoning(text: str, start: int, final: bool) -> ReasoningScan:
    """The span from `start`: its text up to `</think>`, then the content."""
    start = skip_whitespace(text, start)
    close = text.find(CLOSE, start)
    if close >= 0:
        content_start = skip_whitespace(text, close + len(CLOSE))
        return ReasoningScan(text[start:close].rstrip(), text[content_start:], True)
    span = text[start:]
    if not final:
        span = span[:len(span) - held_prefix(span, CLOSE)]
    return ReasoningScan(span.rstrip(), "", True)


class Qwen3Parser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True
