"""Decoding for byte-level BPE (GPT-2, Llama 3, Qwen) without a call into the Rust tokenizer.

Such a tokenizer's decode is a pure function of bytes: each vocabulary token stands for fixed bytes (written with
GPT-2's byte → printable-character table), the decode joins them and reads the result as UTF-8, each invalid run
becoming one U+FFFD. Python's "replace" error handler replaces exactly the same runs as Rust's `from_utf8_lossy`,
so a table of token bytes gives the Rust decode's text. For the few-token windows the detokenizer decodes every step,
that skips the call's fixed cost, most of what such a decode costs. Added and special tokens are not in the table:
a window holding one goes to the Rust decode, which knows where to place or skip them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any


class FastDecoding:
    """Decoders of id lists for one Rust tokenizer: through its byte table when it is byte-level BPE."""

    def __init__(self, backend: Any) -> None:
        self._rust_decode = backend.decode
        self._table = byte_level_table(backend)

    def decoder(self, skip_special_tokens: bool) -> Callable[[list[int]], str]:
        rust_decode = self._rust_decode  # skips special tokens by default; bound: no Python frame in between
        if not skip_special_tokens:
            rust_decode = partial(rust_decode, skip_special_tokens=False)
        return rust_decode if self._table is None else table_decoder(self._table, rust_decode)


def byte_level_table(backend: Any) -> list[bytes | None] | None:
    """Each id's bytes when `backend` (a `tokenizers.Tokenizer`) decodes with a plain ByteLevel decoder; None for
    added and special tokens. None for other decoders (byte fallback, metaspace, sequences), whose rules differ."""
    from tokenizers.decoders import ByteLevel

    if not isinstance(backend.decoder, ByteLevel):
        return None
    to_byte = _byte_of_char()
    as_latin1 = {ord(char): chr(byte) for char, byte in to_byte.items()}  # then .encode("latin-1") gives the bytes
    table_chars_removed = dict.fromkeys(map(ord, to_byte))  # a translation leaving only characters outside it
    vocab = backend.get_vocab(with_added_tokens=False)
    added = backend.get_added_tokens_decoder()
    table: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, index in vocab.items():
        if index not in added:
            # As the Rust decoder does: a token with a character outside the table stands for its UTF-8 bytes.
            outside = token.translate(table_chars_removed)
            table[index] = token.encode() if outside else token.translate(as_latin1).encode("latin-1")
    return table


def table_decoder(table: list[bytes | None], fallback: Callable[[list[int]], str]) -> Callable[[list[int]], str]:
    """A decode of ids through `table`; `fallback` takes windows holding an id the table lacks."""

    def decode(ids: list[int]) -> str:
        try:
            return b"".join([table[i] for i in ids]).decode("utf-8", "replace")
        except (TypeError, IndexError):  # an added or special token (None), or an id past the vocabulary
            return fallback(ids)

    return decode


def _byte_of_char() -> dict[str, int]:
    """GPT-2's table, inverted: the printable character standing for each byte → that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    others = [byte for byte in range(256) if byte not in chars]
    chars.update({byte: chr(256 + n) for n, byte in enumerate(others)})
    return {char: byte for byte, char in chars.items()}
