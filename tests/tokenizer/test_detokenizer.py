"""Streaming detokenization: deltas join to the full decode byte for byte and never hold half a character."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jengine.tokenizer import IncrementalDetokenizer, Tokenizer

REPLACEMENT = "\ufffd"
TEXT = "Hello, world! 你好，世界。日本語のテキスト。한국어 🙂🚀👍🏽 👨‍👩‍👧 Crème brûlée naïve 龘 𝔘nicode  two  spaces\tend"
ALPHABET = sorted(set(TEXT + "abc xyz.,!?\n龘𝔘🦀Ωж€"))
FEW_EXAMPLES = settings(max_examples=50, deadline=None)


def _stream(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    chunks: Sequence[int] = (1,),
    skip_special_tokens: bool = True,
    prompt: Sequence[int] | None = None,
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Push `ids` in chunks of the given sizes (cycled), then finish; return the detokenizer and its deltas."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas, pos, step = [], 0, 0
    while pos < len(ids):
        size = chunks[step % len(chunks)]
        deltas.append(detok.push(ids[pos : pos + size]))
        pos, step = pos + size, step + 1
    deltas.append(detok.finish())
    return detok, deltas


def _non_byte_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids that are not byte-fallback tokens: a random mix of them is always valid UTF-8 when decoded."""
    tokens = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
    return [i for i, t in enumerate(tokens) if not (len(t) == 6 and t.startswith("<0x"))]


@pytest.mark.parametrize("chunks", [(1,), (2,), (3, 1), (100,)])
def test_streams_multilingual_text_exactly(tokenizer: Tokenizer, chunks: tuple[int, ...]) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok, deltas = _stream(tokenizer, ids, chunks)
    assert "".join(deltas) == detok.text == TEXT == tokenizer.decode(ids)
    assert detok.token_ids == ids
    assert not any(REPLACEMENT in d for d in deltas)


def test_holds_back_half_characters(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a龘b", add_special_tokens=False)
    assert len(ids) >= 4  # "龘" is three bytes over several tokens in both kinds
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([i]) for i in ids]
    assert deltas[0] == "a" and deltas[-1] == "b"
    assert "".join(deltas[1:-1]) == "龘" and deltas[-2] == "龘"


def test_finish_flushes_an_incomplete_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("x龘", add_special_tokens=False)[:-1]
    detok, deltas = _stream(tokenizer, ids)
    assert deltas[-1].endswith(REPLACEMENT)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert detok.finish() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: Tokenizer, skip: bool) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\n你好 there<|im_end|></s>", add_special_tokens=True)
    detok, deltas = _stream(tokenizer, ids, skip_special_tokens=skip)
    expected = "assistant\n你好 there" if skip else "<s><|im_start|>assistant\n你好 there<|im_end|></s>"
    assert "".join(deltas) == detok.text == expected == tokenizer.decode(ids, skip_special_tokens=skip)


def test_prompt_gives_context_for_the_first_delta(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("The cat")
    full = tokenizer.encode("The cat sat on the mat 🙂")
    assert full[: len(prompt)] == prompt
    _, deltas = _stream(tokenizer, full[len(prompt) :], prompt=prompt)
    assert "".join(deltas) == " sat on the mat 🙂"  # the leading space survives in both kinds


def test_window_stays_small(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    longest = 0
    for i in ids:
        detok.push([i])
        longest = max(longest, len(detok._window))
    assert longest <= 12 and detok.text == TEXT * 20


def test_empty_push(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push([]) == "" and detok.finish() == "" and detok.text == ""


@FEW_EXAMPLES
@given(text=st.text(alphabet=ALPHABET, max_size=40), chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_random_text_streams_exactly(tokenizer: Tokenizer, text: str, chunks: list[int]) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    _, deltas = _stream(tokenizer, ids, chunks)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert tokenizer.decode(ids) == text or text.startswith(" ")  # metaspace drops one leading space, as Llama-2
    assert not any(REPLACEMENT in d for d in deltas)


@FEW_EXAMPLES
@given(data=st.data(), skip=st.booleans())
def test_random_token_ids_stream_exactly(tokenizer: Tokenizer, data: st.DataObject, skip: bool) -> None:
    """Any ids, split characters included; byte-fallback ids are left out because an invalid byte-fallback run
    rewrites the bytes before it (a quirk of that decoder, not of ordinary generations)."""
    pool = _non_byte_ids(tokenizer)
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=40), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5), label="chunks")
    _, deltas = _stream(tokenizer, ids, chunks, skip_special_tokens=skip)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full
    if REPLACEMENT not in full:
        assert not any(REPLACEMENT in d for d in deltas)
