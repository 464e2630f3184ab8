"""The tiny tokenizer builder: deterministic, fast, loadable by transformers, and buildable without it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import transformers

from jengine.tokenizer import CHATML_TEMPLATE, train_tiny_tokenizer

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_training_is_deterministic_and_fast(tmp_path: Path, kind: str) -> None:
    start = time.perf_counter()
    first = train_tiny_tokenizer(tmp_path / "a", kind=kind, chat_template=CHATML_TEMPLATE)
    assert time.perf_counter() - start < 2.0
    second = train_tiny_tokenizer(tmp_path / "b", kind=kind, chat_template=CHATML_TEMPLATE)
    for name in FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
@pytest.mark.parametrize("vocab_size", [384, 512])
def test_loads_with_transformers_in_llama_layout(tmp_path: Path, kind: str, vocab_size: int) -> None:
    path = train_tiny_tokenizer(tmp_path, vocab_size=vocab_size, kind=kind)
    hf = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert len(hf) == vocab_size
    assert hf.convert_ids_to_tokens([0, 1, 2]) == ["<unk>", "<s>", "</s>"]
    assert (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert {hf.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")} <= set(hf.all_special_ids)
    ids = hf.encode("hello")
    assert ids[0] == 1 and 1 not in hf.encode("hello", add_special_tokens=False)


def test_chat_template_is_written_only_when_given(tmp_path: Path) -> None:
    with_template = train_tiny_tokenizer(tmp_path / "a", chat_template="{{ messages }}")
    without = train_tiny_tokenizer(tmp_path / "b")
    assert '"chat_template": "{{ messages }}"' in (with_template / "tokenizer_config.json").read_text()
    assert "chat_template" not in (without / "tokenizer_config.json").read_text()


def test_bytelevel_splits_multibyte_characters(tmp_path: Path) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(str(train_tiny_tokenizer(tmp_path)), local_files_only=True)
    ids = hf.encode("龘🚀", add_special_tokens=False)
    assert len(ids) > 2
    assert any("\ufffd" in hf.decode([i]) for i in ids)


def test_metaspace_falls_back_to_bytes_for_rare_characters(tmp_path: Path) -> None:
    path = train_tiny_tokenizer(tmp_path, kind="metaspace")
    hf = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tokens = hf.convert_ids_to_tokens(hf.encode("a 龘🚀", add_special_tokens=False))
    assert tokens[:2] == ["▁a", "▁"]
    assert tokens[2:] == ["<0xE9>", "<0xBE>", "<0x98>", "<0xF0>", "<0x9F>", "<0x9A>", "<0x80>"]


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        train_tiny_tokenizer(tmp_path, kind="wordpiece")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least"):
        train_tiny_tokenizer(tmp_path, vocab_size=300, kind="metaspace")


def test_builds_without_transformers_or_torch(tmp_path: Path) -> None:
    script = f"""
import sys
sys.modules["transformers"] = None
sys.modules["torch"] = None
from tokenizers import Tokenizer
from jengine.tokenizer import train_tiny_tokenizer
for kind in ("bytelevel", "metaspace"):
    path = train_tiny_tokenizer({str(tmp_path)!r} + "/" + kind, kind=kind)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = "naïve 你好 🙂"
    assert tok.decode(tok.encode(text).ids) == text, kind
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
