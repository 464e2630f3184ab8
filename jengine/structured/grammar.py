"""StructuredOutputsParams → an llguidance grammar → per-request matchers, made in the front (it has the tokenizer).

Compiling is the expensive part (a schema's grammar, lexer and token trie): a compiled matcher is kept per grammar,
keyed by the sha256 of its text, and each request gets a copy (`deep_copy`, cheap) that its core request carries and
advances. Errors in the user's constraint (a bad schema, regex or grammar) are InvalidRequestError naming the field,
found when the request is checked, before admission. llguidance is imported only when the first constraint comes.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from typing import Any

from jengine.errors import InvalidRequestError
from jengine.structured.params import StructuredOutputsParams

MAX_CACHED_GRAMMARS = 256  # compiled matchers kept (least recently used dropped first)
_PARAM = {"json": "json_schema", "json_object": "response_format"}  # the field an error names


def grammar_text(params: StructuredOutputsParams, special_tokens: frozenset[str] = frozenset()) -> str:
    """The llguidance grammar (its JSON or Lark text) of `params`; InvalidRequestError when it cannot be built.
    `special_tokens`: the tokenizer's added tokens (a structural tag's `<...>` trigger may be one)."""
    import llguidance

    params.validate()
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            if params.disable_additional_properties:
                schema = _closed(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_json_options(params))
        if kind == "regex":
            return llguidance.grammar_from("regex", params.regex)
        if kind == "choice":
            return "start: " + " | ".join(json.dumps(option) for option in params.choice)
        if kind == "grammar":
            return llguidance.grammar_from("lark", params.grammar)
        return _structural_tag_grammar(params.structural_tag, _json_options(params), special_tokens)
    except Exception as exc:  # llguidance's builders raise several types on user input: each is a bad constraint
        raise InvalidRequestError(f"invalid {kind}: {str(exc)[:300]}", param=_PARAM.get(kind, kind)) from None


def _closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that leaves it unset (vLLM's
    disable_additional_properties)."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if (closed.get("type") == "object" or "properties" in closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _json_options(params: StructuredOutputsParams) -> dict[str, Any]:
    return {"whitespace_flexible": not params.disable_any_whitespace}


def _structural_tag_grammar(tag: dict[str, Any], json_options: dict[str, Any], special_tokens: frozenset[str]
                            ) -> str:
    """vLLM's {"structures": [{"begin", "schema", "end"}], "triggers": [...]}: free text with tagged JSON spans. A
    `<...>` trigger is matched as the special token when every such trigger is one, else as text."""
    import llguidance

    triggers = tag.get("triggers") or []
    tags = []
    for structure in tag["structures"]:
        begin = structure["begin"]
        trigger = next((t for t in triggers if begin.startswith(t)), begin)
        schema = {**structure.get("schema", {}), "x-guidance": json_options}  # the spans are JSON: same spacing
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=structure.get("end", "")))
    bracketed = [t.trigger for t in tags if t.trigger.startswith("<") and t.trigger.endswith(">")]
    return llguidance.StructTag.to_grammar(tags, assume_special=all(t in special_tokens for t in bracketed))


class GrammarCompiler:
    """Compiled matchers for one tokenizer, cached by grammar hash; safe to use from several threads."""

    def __init__(self, hf_tokenizer: Any) -> None:
        import llguidance.hf

        self.ll_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
        self.vocab_size = self.ll_tokenizer.vocab_size  # the bitmask covers ceil(vocab_size / 32) words
        self.special_tokens = frozenset(t.content for t in getattr(hf_tokenizer, "added_tokens_decoder", {}).values())
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def check(self, params: StructuredOutputsParams) -> None:
        """Compile (or find compiled) `params`' grammar; InvalidRequestError naming the problem if it does not."""
        self._compiled(params)

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh matcher of `params` (a copy of the cached compiled one), for one request to advance."""
        return self._compiled(params).deep_copy()

    def _compiled(self, params: StructuredOutputsParams) -> Any:
        text = grammar_text(params, self.special_tokens)
        key = hashlib.sha256(text.encode()).hexdigest()
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        compiled = self._compile(params, text)  # outside the lock: compiling drops the GIL, others may proceed
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams, text: str) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            kind = params.kind
            raise InvalidRequestError(f"invalid {kind}: {_first_line(matcher.get_error())}",
                                      param=_PARAM.get(kind, kind))
        return matcher


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0][:300] if error.strip() else "the grammar does not compile"
