"""What every tool-call parser is: a pure reading of the text so far, `scan(text, final)`, that only ever grows.

A parser reads the content text a model wrote (after any reasoning span) and says which part is plain content and
which calls it holds. `final=False` is a stream's reading: it commits only what more text cannot change (a marker
still arriving is held back, a call appears once its name is complete, arguments grow as written). `final=True` is
the reading of the finished text. For any text and any longer text, the earlier reading is a prefix of the later
one, field by field; `jengine.tools.stream` turns the growth into OpenAI deltas, so a stream reassembles exactly to
the non-streamed message, however it was split. Parsers keep no state but scan caches (they resume work already
done on the text's shared prefix).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import ClassVar

from jengine.tools.json_scan import ObjectScanner, held_prefix


@dataclasses.dataclass
class PartialCall:
    """A call as far as it is known: its whole name, and its arguments' JSON text so far."""

    name: str
    arguments: str


@dataclasses.dataclass
class ToolScan:
    """One reading: the plain content so far and the calls in order."""

    content: str = ""
    calls: list[PartialCall] = dataclasses.field(default_factory=list)


class ToolParser:
    """One model family's tool-call format (subclasses register under `name` in `jengine.tools.parsers`)."""

    name: ClassVar[str]
    # The format's markers are special tokens, which a default decode drops: the request must keep them in its text.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self) -> None:
        self._objects: dict[int, ObjectScanner] = {}

    def scan(self, text: str, final: bool) -> ToolScan:
        raise NotImplementedError

    def extract(self, text: str) -> ToolScan:
        """The non-streaming reading of a whole reply (streams read through `jengine.tools.stream.ChoiceParser`,
        which reassembles to exactly this)."""
        return type(self)().scan(text, final=True)

    def new_call_id(self) -> str:
        """An id for the next call (vLLM's form; formats whose templates check ids override it)."""
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def scan_object(self, text: str, start: int) -> ObjectScanner:
        """The scan of the JSON object opening at `start`, resumed from where the previous reading left it."""
        scanner = self._objects.get(start)
        if scanner is None:
            scanner = self._objects[start] = ObjectScanner(start)
        scanner.advance(text)
        return scanner


def call_of_object(scanner: ObjectScanner, text: str) -> PartialCall | None:
    """The call an object of the `{"name": ..., "arguments" (or "parameters"): {...}}` form holds, once its name is
    complete; None before that, or when it has no string name. Missing arguments read as `{}` once the object ends."""
    name_member = scanner.member("name")
    name_text = name_member.text(text) if name_member is not None else None
    if name_text is None or not name_text.startswith('"'):
        return None
    name = json.loads(name_text)
    arguments = scanner.member("arguments", "parameters")
    if arguments is None or arguments.start is None:
        return PartialCall(name, "{}" if scanner.closed else "")
    if arguments.end is not None:
        return PartialCall(name, text[arguments.start:arguments.end])
    opened = text[arguments.start] in '{["'  # an open container or string grows as written; a number may not
    return PartialCall(name, text[arguments.start:] if opened else "")


def plain_until(text: str, marker: str, start: int, final: bool) -> tuple[str, int]:
    """(content from `start` up to the next `marker`, the marker's index or -1); the end of the text that may still
    become the marker is held back unless `final`."""
    index = text.find(marker, start)
    if index >= 0:
        return text[start:index], index
    rest = text[start:]
    return (rest if final else rest[:len(rest) - held_prefix(rest, marker)]), -1
