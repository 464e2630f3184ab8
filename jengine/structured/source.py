"""The front's handle on grammars: compiles lazily for one tokenizer and gives each core request its own matcher."""

from __future__ import annotations

import threading
from typing import Any

from jengine.structured.grammar import GrammarCompiler
from jengine.structured.masks import RequestGrammar
from jengine.structured.params import StructuredOutputsParams


class GrammarSource:
    """Builds the llguidance tokenizer on the first constrained request (a free-only engine never imports it)."""

    def __init__(self, tokenizer: Any) -> None:
        """`tokenizer`: jengine's Tokenizer (its `hf_tokenizer` must be a fast Hugging Face tokenizer)."""
        self._tokenizer = tokenizer
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer.hf_tokenizer)
            return self._compiler

    def check(self, params: StructuredOutputsParams) -> None:
        self.compiler.check(params)

    def for_request(self, params: StructuredOutputsParams | None, reasoning_end: tuple[int, ...] = ()
                    ) -> RequestGrammar | None:
        """A fresh matcher for one core request (None for a free one); `reasoning_end`: the token ids after which
        it applies (the end of a reasoning span), () for from the first token."""
        if params is None:
            return None
        compiler = self.compiler
        return RequestGrammar(compiler.matcher(params), -(-compiler.vocab_size // 32), params.kind, reasoning_end)
