"""The core's side of constrained decoding: advance each request's matcher, and pack the allowed tokens of the
constrained rows of a step into an int32 bitmask (bit t of row r: token t allowed), on the host.

Matchers are duck-typed llguidance `LLMatcher`s made in the front; this module imports llguidance only to fill masks
on its Rust thread pool (`LLExecutor`), never a tokenizer, so the core stays free of the text side. The core calls
`fill` between dispatching a step's forward and its sampler, after the previous step's tokens were consumed: the
host work runs while the device computes the forward.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class RequestGrammar:
    """What a core request carries: its own matcher, advanced with every accepted token."""

    matcher: Any  # an llguidance LLMatcher (deep copy of the compiled one)
    vocab_words: int  # int32 words of its bitmask: ceil(tokenizer vocabulary / 32)
    kind: str  # the constraint's kind (StructuredOutputsParams.kind)


def advance(request: Any, token_ids: Sequence[int]) -> None:
    """Feed a request's newly accepted tokens to its matcher (a rejected token leaves it in its error state, which
    then allows only EOS: the output ends instead of going on unconstrained)."""
    if request.grammar is None or not token_ids or request.grammar.matcher.is_stopped():
        return
    matcher = request.grammar.matcher
    if not matcher.consume_tokens(list(token_ids)) and not matcher.is_stopped():
        logger.warning("request %s: sampled token rejected by its grammar (%s)", request.request_id,
                       matcher.get_error()[:200])


class MaskFiller:
    """Fills the bitmask rows of constrained requests; one per engine core (owns the llguidance thread pool)."""

    def __init__(self) -> None:
        self._executor: Any = None

    def fill(self, requests: Sequence[Any]) -> tuple[np.ndarray, np.ndarray] | None:
        """(row indices, [k, words] int32 masks) for the requests with a grammar, in the order given (None: none;
        a None entry is a row without a request)."""
        pairs = [(request.grammar.matcher, row) for row, request in enumerate(requests)
                 if request is not None and request.grammar is not None]
        if not pairs:
            return None
        import llguidance
        import llguidance.numpy

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        vocab_words = next(r.grammar.vocab_words for r in requests if r is not None and r.grammar is not None)
        masks = np.zeros((len(pairs), vocab_words), np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(m, k) for k, (m, _) in enumerate(pairs)],
                                                     masks)
        return np.array([row for _, row in pairs], np.int32), masks
