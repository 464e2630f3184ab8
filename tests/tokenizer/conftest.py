"""Tiny trained tokenizers of both kinds, built once per session (training takes milliseconds, loading ~0.1 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jengine.tokenizer import CHATML_TEMPLATE, Tokenizer, train_tiny_tokenizer

KINDS = ("bytelevel", "metaspace")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tokenizer directory per kind, each with the ChatML template in tokenizer_config.json."""
    root = tmp_path_factory.mktemp("tiny_tokenizers")
    return {kind: train_tiny_tokenizer(root / kind, kind=kind, chat_template=CHATML_TEMPLATE) for kind in KINDS}


@pytest.fixture(scope="session")
def no_template_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer directory whose model ships no chat template at all."""
    return train_tiny_tokenizer(tmp_path_factory.mktemp("no_template"), kind="bytelevel")


@pytest.fixture(scope="session")
def tokenizers(tiny_dirs: dict[str, Path]) -> dict[str, Tokenizer]:
    """Loaded tokenizers by kind, shared by the session."""
    return {kind: Tokenizer.from_pretrained(path) for kind, path in tiny_dirs.items()}


@pytest.fixture(scope="session", params=KINDS)
def tokenizer(request: pytest.FixtureRequest, tokenizers: dict[str, Tokenizer]) -> Tokenizer:
    """Each kind in turn."""
    return tokenizers[request.param]
