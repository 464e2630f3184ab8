"""Incremental detokenization: turn a growing list of token ids into text deltas, safely for UTF-8.

A token is not a character. Byte-level BPE and byte-fallback tokens can end halfway through a multi-byte character, and
SentencePiece-style tokenizers drop or keep a token's leading space depending on what precedes it. Decoding each token
alone gets both wrong; decoding everything again each step costs O(n) per token. So, as vLLM does, we decode a short
window: a few released tokens (the *prefix*, context for spacing and byte merges) and the tokens since. The delta is
what the window's text adds to the prefix's text, held back while it ends in U+FFFD, the mark of a character whose
remaining bytes have not arrived yet. After a release the whole window becomes the prefix, so its text is already
known and a step decodes once; past MAX_PREFIX_TOKENS the prefix restarts from the last delta's tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jengine.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded as context for the first delta, so its leading space and bytes read as a continuation."""
MAX_PREFIX_TOKENS = 4
"""A longer prefix restarts from the last delta's tokens: one extra decode every few steps keeps the window short."""


class IncrementalDetokenizer:
    """Text deltas of one request's generated tokens; `push` each step's new ids, `finish` at the end.

    Whatever is emitted joins to `tokenizer.decode(token_ids)` for ordinary text (no prompt given). The window holds
    at most MAX_PREFIX_TOKENS released tokens plus the unreleased ones: a few tokens, since a held UTF-8 character
    needs at most four bytes. Only a stream of invalid bytes can make it grow; it stays exact then and flushes at
    `finish`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        """Start after `prompt_token_ids` (their last few tokens give context; they are never emitted)."""
        self._decode = tokenizer.decoder(skip_special_tokens,
                                         spaces_between_special_tokens=spaces_between_special_tokens)
        self._window: list[int] = list(prompt_token_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self._read = len(self._window)  # window[:_read] is the prefix; window[_read:] is not yet released
        self._prefix_text: str | None = None  # decode of the prefix, computed when not known
        self._chunks: list[str] = []
        self.token_ids: list[int] = []

    @property
    def text(self) -> str:
        """All text released so far."""
        return "".join(self._chunks)

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete ("" while a character or a space is still pending)."""
        if not new_token_ids:
            return ""
        self.token_ids.extend(new_token_ids)
        self._window.extend(new_token_ids)
        window_text = self._decode(self._window)
        if window_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._release(window_text)

    def finish(self) -> str:
        """Release whatever is held, invalid bytes included (they decode to U+FFFD, as a full decode shows them)."""
        if self._read == len(self._window):
            return ""
        return self._release(self._decode(self._window))

    def _release(self, window_text: str) -> str:
        """Emit what the window adds to the prefix; the window becomes the next prefix, its text known, or once too
        long, the released tokens do (their text decoded when next needed)."""
        prefix = self._prefix_text if self._prefix_text is not None else self._prefix()
        # The common case inline (this runs per request per step); _added_text handles a changed prefix decode.
        delta = window_text[len(prefix) :] if window_text.startswith(prefix) else _added_text(prefix, window_text)
        if not delta:  # e.g. a skipped special token: keep it in the window, its neighbours' spacing depends on it
            return ""
        if len(self._window) <= MAX_PREFIX_TOKENS:
            self._prefix_text = window_text
        else:
            self._window = self._window[self._read :]
            self._prefix_text = None
        self._read = len(self._window)
        self._chunks.append(delta)
        return delta

    def _prefix(self) -> str:
        """Text of the prefix tokens, decoded only when the prefix restarted."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        return self._prefix_text


def _added_text(prefix: str, text: str) -> str:
    """What `text` adds after `prefix`; after the longest common start if the prefix's decode changed.

    It changes only with the window's first bytes: a prompt that ends mid-character, or byte-fallback bytes that a
    later invalid byte turns into U+FFFD. The text released before cannot be taken back, so the rest is sent.
    """
    if text.startswith(prefix):
        return text[len(prefix) :]
    common = 0
    for a, b in zip(prefix, text):
        if a != b:
            break
        common += 1
    logger.debug("detokenizer prefix changed after %d of %d chars", common, len(prefix))
    return text[common:]
